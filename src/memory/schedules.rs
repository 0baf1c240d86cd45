//! Schedule records: what the scheduler read and wrote, as its SQL does.

use std::collections::BTreeMap;

use crate::config::AppConfig;
use crate::scheduler::{ScheduleRecord, ScheduleWrite};
use crate::store::{DbTime, EnqueueError};
use crate::task::TaskId;

use super::MemoryStore;

impl MemoryStore {
    /// Each recorded schedule's last tick, as [`Scheduler::plan`](crate::scheduler::Scheduler::plan)
    /// reads them.
    pub fn schedule_ticks(&self) -> BTreeMap<String, DbTime> {
        self.schedules.iter().map(|(name, record)| (name.clone(), record.last_tick)).collect()
    }

    /// The record of schedule `name`, if it has one.
    pub fn schedule_record(&self, name: &str) -> Option<&ScheduleRecord> {
        self.schedules.get(name)
    }

    /// Applies one write of a scheduler's plan as PostgreSQL does, atomically: a new schedule's
    /// record is inserted only if it has none; an existing one advances only if it still holds
    /// the tick the plan read (compare-and-set), and then its tasks are enqueued with it.
    /// Returns the new tasks' ids, or `None` when another scheduler got there first (nothing
    /// is written). A refused enqueue writes nothing either.
    pub fn apply_schedule_write(
        &mut self,
        write: &ScheduleWrite,
        now: DbTime,
    ) -> Result<Option<Vec<TaskId>>, EnqueueError> {
        let current = self.schedules.get(&write.name).map(|record| record.last_tick);
        if current != write.read {
            return Ok(None);
        }
        let ids = if write.tasks.is_empty() { Vec::new() } else { self.enqueue_many(write.tasks.clone(), now)? };
        let record = self.schedules.entry(write.name.clone()).or_insert_with(|| ScheduleRecord {
            name: write.name.clone(),
            last_tick: write.advance_to,
            next_tick: None,
            last_task_id: None,
            run_count: 0,
            updated_at: now,
        });
        record.last_tick = write.advance_to;
        record.next_tick = write.next_tick;
        record.run_count += ids.len() as u64;
        record.last_task_id = ids.last().copied().or(record.last_task_id);
        record.updated_at = now;
        Ok(Some(ids))
    }

    /// The application configuration enqueues are checked against.
    pub fn app(&self) -> &AppConfig {
        &self.app
    }
}
