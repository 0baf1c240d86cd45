//! Configuration checks: every violated rule as a [`ConfigProblem`] (the field, its value,
//! what is allowed), collected by a `Check` under a dotted prefix and reported together as
//! one [`ConfigError`]. A leaf: the configuration, schedules and stores check with it.

use std::fmt;
use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

/// One violated rule: the field, its value, and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigProblem {
    /// The field's dotted path, e.g. `app.recovery.check_interval_ms` or
    /// `app.custom_queues[2].name`.
    pub field: String,
    /// The offending value as written in a file (strings quoted).
    pub value: String,
    /// What the field allows.
    pub expected: String,
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` is {}, expected {}", self.field, self.value, self.expected)
    }
}

/// Every problem found in one configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration: {}", describe_problems(.problems))]
pub struct ConfigError {
    /// The problems: the app's before the worker's, each table's in field order.
    pub problems: Vec<ConfigProblem>,
}

impl ConfigError {
    /// The fields with a problem, in order (a field may appear twice).
    pub fn fields(&self) -> impl Iterator<Item = &str> {
        self.problems.iter().map(|p| p.field.as_str())
    }

    /// The first problem of `field`, if it has one.
    pub fn problem(&self, field: &str) -> Option<&ConfigProblem> {
        self.problems.iter().find(|p| p.field == field)
    }

    pub(crate) fn from_problems(problems: Vec<ConfigProblem>) -> Result<(), ConfigError> {
        if problems.is_empty() { Ok(()) } else { Err(ConfigError { problems }) }
    }
}

fn describe_problems(problems: &[ConfigProblem]) -> String {
    let count = problems.len();
    let noun = if count == 1 { "problem" } else { "problems" };
    let list: Vec<String> = problems.iter().map(ToString::to_string).collect();
    format!("{count} {noun}: {}", list.join("; "))
}

/// Collects problems, naming fields under a dotted prefix.
pub(crate) struct Check<'a> {
    prefix: String,
    problems: &'a mut Vec<ConfigProblem>,
}

impl<'a> Check<'a> {
    pub(crate) fn root(problems: &'a mut Vec<ConfigProblem>) -> Self {
        Check { prefix: String::new(), problems }
    }

    /// A collector for the fields of the table `name`.
    pub(crate) fn nested(&mut self, name: &str) -> Check<'_> {
        Check { prefix: format!("{}{name}.", self.prefix), problems: &mut *self.problems }
    }

    pub(crate) fn problem(&mut self, field: &str, value: impl fmt::Display, expected: impl Into<String>) {
        self.problems.push(ConfigProblem {
            field: format!("{}{field}", self.prefix),
            value: value.to_string(),
            expected: expected.into(),
        });
    }

    /// Reports `value` unless it lies in `allowed`; says whether it does.
    pub(crate) fn range<T: PartialOrd + fmt::Display>(
        &mut self,
        field: &str,
        value: T,
        allowed: RangeInclusive<T>,
    ) -> bool {
        if allowed.contains(&value) {
            return true;
        }
        let expected = format!("{} to {}", allowed.start(), allowed.end());
        self.problem(field, value, expected);
        false
    }
}
