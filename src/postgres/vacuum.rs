//! Canter's own vacuum of its hot tables ([`DbRequest::Vacuum`](crate::store::DbRequest::Vacuum)).
//!
//! Every finished task leaves two or three dead row versions in `tasks` (its insert, its claim,
//! its start) and an index entry for each. PostgreSQL prunes dead versions inside a page as it
//! reads it, but only a vacuum frees the line pointers and index entries for good and lets the
//! table stop growing: on a server without autovacuum (or where it falls behind a queue's
//! churn) the live table grows without bound and every claim walks more of it. So workers
//! vacuum the hot tables themselves, when the statistics count enough dead rows more than
//! their last vacuum left: a vacuum that could remove nothing (an open snapshot holds the dead
//! rows) is not repeated until more dead rows pile up, or a minute has passed.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::PgConnection;

use super::PgStore;
use super::replay::in_own_transaction;
use crate::store::VacuumedTable;

/// The tables Canter vacuums: those whose size follows the work in flight, not history
/// (`finished_tasks` and `attempts` only grow, and are left to the server and the purge), and
/// `listeners` and `waiting_workers`, a row in and out per result wait and per worker running
/// out of work.
pub const HOT_TABLES: &[&str] = &[
    "tasks",
    "task_keys",
    "workers",
    "claim_locks",
    "queue_states",
    "reaper_lock",
    "listeners",
    "waiting_workers",
    "task_gates",
];

/// How long what a vacuum left behind keeps the next one away (unless more piles up): the
/// open snapshot that held those rows has likely ended by then.
const LEFT_FORGOTTEN_AFTER: Duration = Duration::from_secs(60);

/// What this store's last vacuum of each table left, and when.
#[derive(Debug, Default)]
pub(crate) struct VacuumMemory {
    left: Mutex<BTreeMap<String, (u64, Instant)>>,
}

impl VacuumMemory {
    /// Whether `table`, with `dead` dead rows, is worth a vacuum at threshold `min`.
    // Bookkeeping of the I/O adapter, not the core's time.
    #[allow(clippy::disallowed_methods)]
    fn due(&self, table: &str, dead: u64, min: u64) -> bool {
        let left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        match left.get(table) {
            Some(&(rows, at)) if at.elapsed() < LEFT_FORGOTTEN_AFTER => dead >= rows.saturating_add(min),
            _ => dead >= min,
        }
    }

    #[allow(clippy::disallowed_methods)]
    fn record(&self, table: &str, dead_after: u64) {
        let mut left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        left.insert(table.to_owned(), (dead_after, Instant::now()));
    }
}

impl PgStore {
    /// Vacuums the hot tables of the schema with at least `min_dead_rows` dead rows more than
    /// this store's last vacuum left in them; see the module documentation.
    pub(crate) async fn vacuum_on(
        &self,
        conn: &mut PgConnection,
        min_dead_rows: u64,
    ) -> Result<Vec<VacuumedTable>, sqlx::Error> {
        let min = i64::try_from(min_dead_rows).unwrap_or(i64::MAX);
        // Through a pooler in transaction mode, no named statement (see `Stmt`).
        let pooled = self.schema().is_transaction_pooled();
        // Only tables this role may vacuum (their owner's privileges: a superuser has every
        // role's): PostgreSQL skips the others with a warning, which would pass for a vacuum
        // that removed nothing. A worker with only DML grants leaves them to the server.
        let counts = "SELECT s.relname::text, s.n_dead_tup FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid \
                      WHERE s.schemaname = $1 AND s.relname = ANY ($2) AND s.n_dead_tup >= $3 \
                      AND pg_has_role(c.relowner, 'USAGE') ORDER BY s.relname";
        let candidates: Vec<(String, i64)> = in_own_transaction!(pooled, &mut *conn, |conn| sqlx::query_as(counts)
            .persistent(!pooled)
            .bind(self.schema().name())
            .bind(HOT_TABLES)
            .bind(min)
            .fetch_all(conn))?;
        let mut vacuumed = Vec::new();
        for (table, dead) in candidates {
            let dead_before = u64::try_from(dead).unwrap_or(0);
            if !self.vacuum.due(&table, dead_before, min_dead_rows) {
                continue;
            }
            // Not in a transaction (VACUUM refuses one); SKIP_LOCKED: a table another vacuum
            // (autovacuum, another worker) is working on is skipped, never waited for.
            let sql = format!("VACUUM (SKIP_LOCKED) {}.\"{table}\"", self.schema().quoted());
            if let Err(error) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut *conn).await {
                // Cancelled at the statement timeout on a bloated table, say: not tried again
                // before more dead rows pile up or a minute passes.
                self.vacuum.record(&table, dead_before);
                return Err(error);
            }
            // The statistics of the vacuum are reported as it ends: a fresh read (outside any
            // transaction's statistics snapshot) sees what it left.
            let after: Option<i64> = in_own_transaction!(pooled, &mut *conn, |conn| sqlx::query_scalar(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2"
            )
            .persistent(!pooled)
            .bind(self.schema().name())
            .bind(&table)
            .fetch_optional(conn))?;
            let dead_after = after.map_or(dead_before, |n| u64::try_from(n).unwrap_or(0));
            self.vacuum.record(&table, dead_after);
            vacuumed.push(VacuumedTable { table, dead_before, dead_after });
        }
        Ok(vacuumed)
    }
}
