//! The per-edge decision: how a parent's finish changes its child's counts, and what the
//! counts decide. Everything a store needs to promote or skip a waiting step.

use serde::{Deserialize, Serialize};

use super::spec::{EdgePolicy, Join, ParentOutcome};

/// A waiting step's parents, counted by how they stand: the only state its join needs.
///
/// A store keeps these three numbers on the waiting step's row and updates them with
/// [`on_parent_finished`] as parents finish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct JoinCounts {
    /// All of the step's parents.
    pub parents: u32,
    /// Parents that finished in a way that satisfies their edge: completed, or any finish on
    /// an [`AllowFailed`](EdgePolicy::AllowFailed) edge.
    pub satisfied: u32,
    /// Parents that finished in a way that does not: failed, cancelled, expired or skipped on
    /// a [`RequireSuccess`](EdgePolicy::RequireSuccess) edge.
    pub unsatisfied: u32,
}

impl JoinCounts {
    /// The counts of a step with `parents` parents, none finished.
    pub fn new(parents: u32) -> Self {
        JoinCounts { parents, satisfied: 0, unsatisfied: 0 }
    }

    /// Parents not finished yet.
    pub fn unfinished(&self) -> u32 {
        self.parents.saturating_sub(self.satisfied.saturating_add(self.unsatisfied))
    }
}

/// What a waiting step's join says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Not decided yet: it depends on parents still unfinished.
    Wait,
    /// Satisfied: the step becomes claimable.
    Ready,
    /// Can no longer be satisfied: the step is skipped, which its children see as a finish.
    Skip,
}

/// The counts after one more of the step's parents finished with `outcome` over an edge of
/// `policy`. A finish beyond the step's number of parents changes nothing.
pub fn on_parent_finished(counts: JoinCounts, policy: EdgePolicy, outcome: ParentOutcome) -> JoinCounts {
    if counts.unfinished() == 0 {
        return counts;
    }
    let mut next = counts;
    if policy.satisfied_by(outcome) {
        next.satisfied += 1;
    } else {
        next.unsatisfied += 1;
    }
    next
}

/// The counts after a parent that had finished with `outcome` over an edge of `policy` is
/// retried (unfinished again): the inverse of [`on_parent_finished`].
pub fn on_parent_reset(counts: JoinCounts, policy: EdgePolicy, outcome: ParentOutcome) -> JoinCounts {
    let mut next = counts;
    if policy.satisfied_by(outcome) {
        next.satisfied = next.satisfied.saturating_sub(1);
    } else {
        next.unsatisfied = next.unsatisfied.saturating_sub(1);
    }
    next
}

/// What `join` decides for a waiting step with these counts.
///
/// With `required` = [`join.required(parents)`](Join::required) (all: every parent, any: 1,
/// quorum(n): n), the whole rule is a threshold:
///
/// - **Ready** when `satisfied >= required`;
/// - **Skip** when `satisfied + unfinished < required`: even if every unfinished parent
///   satisfied its edge, the join would not be;
/// - **Wait** otherwise.
///
/// The two conditions never hold together, and both are monotone: as parents finish,
/// `satisfied` only grows and `satisfied + unfinished` only shrinks, so a decision other than
/// Wait never changes, and once every parent finished it is never Wait. For all, Skip is "one
/// parent finished unsatisfied"; for any, "every parent finished and none satisfied".
pub fn decide(join: Join, counts: &JoinCounts) -> Decision {
    let required = join.required(counts.parents);
    if counts.satisfied >= required {
        Decision::Ready
    } else if counts.satisfied.saturating_add(counts.unfinished()) < required {
        Decision::Skip
    } else {
        Decision::Wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use EdgePolicy::{AllowFailed, RequireSuccess};
    use ParentOutcome::{Cancelled, Completed, Expired, Failed, Skipped};

    fn counts(parents: u32, satisfied: u32, unsatisfied: u32) -> JoinCounts {
        JoinCounts { parents, satisfied, unsatisfied }
    }

    #[test]
    fn only_completion_satisfies_a_required_edge_and_every_finish_an_allow_failed_one() {
        assert!(RequireSuccess.satisfied_by(Completed));
        for outcome in [Failed, Cancelled, Expired, Skipped] {
            assert!(!RequireSuccess.satisfied_by(outcome), "{outcome}");
        }
        for outcome in [Completed, Failed, Cancelled, Expired, Skipped] {
            assert!(AllowFailed.satisfied_by(outcome), "{outcome}");
        }
    }

    #[test]
    fn finishing_counts_one_parent_and_reset_undoes_it() {
        let start = JoinCounts::new(3);
        assert_eq!(start.unfinished(), 3);
        let one = on_parent_finished(start, RequireSuccess, Failed);
        assert_eq!(one, counts(3, 0, 1));
        let two = on_parent_finished(one, AllowFailed, Skipped);
        assert_eq!(two, counts(3, 1, 1));
        assert_eq!(two.unfinished(), 1);
        assert_eq!(on_parent_reset(two, AllowFailed, Skipped), one);
        assert_eq!(on_parent_reset(one, RequireSuccess, Failed), start);
        // No parent left to finish, none finished to reset: nothing changes.
        let full = counts(1, 1, 0);
        assert_eq!(on_parent_finished(full, RequireSuccess, Completed), full);
        assert_eq!(on_parent_reset(start, RequireSuccess, Completed), start);
    }

    #[test]
    fn all_waits_for_every_parent_and_skips_on_the_first_unsatisfied() {
        assert_eq!(decide(Join::All, &counts(0, 0, 0)), Decision::Ready);
        assert_eq!(decide(Join::All, &counts(3, 0, 0)), Decision::Wait);
        assert_eq!(decide(Join::All, &counts(3, 2, 0)), Decision::Wait);
        assert_eq!(decide(Join::All, &counts(3, 3, 0)), Decision::Ready);
        assert_eq!(decide(Join::All, &counts(3, 0, 1)), Decision::Skip);
        assert_eq!(decide(Join::All, &counts(3, 2, 1)), Decision::Skip);
    }

    #[test]
    fn any_is_ready_on_the_first_satisfied_and_skips_when_none_can_be() {
        assert_eq!(decide(Join::Any, &counts(3, 0, 0)), Decision::Wait);
        assert_eq!(decide(Join::Any, &counts(3, 0, 2)), Decision::Wait);
        assert_eq!(decide(Join::Any, &counts(3, 1, 0)), Decision::Ready);
        assert_eq!(decide(Join::Any, &counts(3, 1, 2)), Decision::Ready);
        assert_eq!(decide(Join::Any, &counts(3, 0, 3)), Decision::Skip);
        // Never submitted (the check refuses it), decided without a panic all the same.
        assert_eq!(decide(Join::Any, &counts(0, 0, 0)), Decision::Skip);
    }

    #[test]
    fn quorum_is_ready_at_n_and_skips_when_n_is_out_of_reach() {
        let q = Join::Quorum(2);
        assert_eq!(decide(q, &counts(4, 0, 0)), Decision::Wait);
        assert_eq!(decide(q, &counts(4, 1, 1)), Decision::Wait);
        assert_eq!(decide(q, &counts(4, 1, 2)), Decision::Wait);
        assert_eq!(decide(q, &counts(4, 2, 0)), Decision::Ready);
        assert_eq!(decide(q, &counts(4, 2, 2)), Decision::Ready);
        assert_eq!(decide(q, &counts(4, 0, 3)), Decision::Skip);
        assert_eq!(decide(q, &counts(4, 1, 3)), Decision::Skip);
        // quorum(1) is any; quorum(parents) is all.
        assert_eq!(decide(Join::Quorum(1), &counts(3, 0, 2)), Decision::Wait);
        assert_eq!(decide(Join::Quorum(3), &counts(3, 2, 1)), Decision::Skip);
    }

    #[test]
    fn inconsistent_counts_are_decided_without_a_panic() {
        let odd = counts(2, u32::MAX, u32::MAX);
        assert_eq!(odd.unfinished(), 0);
        assert_eq!(decide(Join::All, &odd), Decision::Ready);
        assert_eq!(decide(Join::Quorum(u32::MAX), &counts(u32::MAX, 0, 0)), Decision::Wait);
    }
}
