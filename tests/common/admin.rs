//! The operator actions as typed calls over `PgStore::admin`, one per `AdminRequest`, so that
//! tests written before the vocabulary read (and assert) as they did.

use canter::postgres::{PgAdminError, PgStore};
use canter::store::{AdminReply, AdminRequest, Cancelled, KeyRemoval, Reschedule};
use canter::task::{TaskId, WorkerId};
use serde_json::Value;

/// Sends `request` and takes the reply of the kind `$variant` names.
macro_rules! reply {
    ($store:expr, $request:expr, $variant:pat => $value:expr) => {{
        let request = $request;
        match $store.admin(&request).await? {
            $variant => Ok($value),
            other => panic!("{request:?} replied {other:?}"),
        }
    }};
}

#[allow(dead_code)]
pub(crate) trait Admin {
    async fn cancel(&self, task: TaskId) -> Result<Cancelled, PgAdminError>;
    async fn requeue_failed(&self, task: TaskId) -> Result<(), PgAdminError>;
    async fn reschedule(&self, task: TaskId, change: Reschedule) -> Result<(), PgAdminError>;
    async fn complete(&self, task: TaskId, result: Value) -> Result<(), PgAdminError>;
    async fn fail(&self, task: TaskId, message: &str) -> Result<(), PgAdminError>;
    async fn force_unlock(&self, workers: &[WorkerId]) -> Result<u64, PgAdminError>;
    async fn remove_key(&self, key: &str) -> Result<KeyRemoval, PgAdminError>;
    async fn purge_finished(&self, retention_ms: u64, batch: u32) -> Result<u64, PgAdminError>;
    async fn pause_queue(&self, queue: &str) -> Result<bool, PgAdminError>;
    async fn resume_queue(&self, queue: &str) -> Result<bool, PgAdminError>;
}

impl Admin for PgStore {
    async fn cancel(&self, task: TaskId) -> Result<Cancelled, PgAdminError> {
        reply!(self, AdminRequest::Cancel { task }, AdminReply::Cancelled { found } => found)
    }
    async fn requeue_failed(&self, task: TaskId) -> Result<(), PgAdminError> {
        reply!(self, AdminRequest::Retry { task }, AdminReply::Done => ())
    }
    async fn reschedule(&self, task: TaskId, change: Reschedule) -> Result<(), PgAdminError> {
        reply!(self, AdminRequest::Reschedule { task, change }, AdminReply::Done => ())
    }
    async fn complete(&self, task: TaskId, result: Value) -> Result<(), PgAdminError> {
        reply!(self, AdminRequest::Complete { task, result }, AdminReply::Done => ())
    }
    async fn fail(&self, task: TaskId, message: &str) -> Result<(), PgAdminError> {
        reply!(self, AdminRequest::Fail { task, message: message.to_owned() }, AdminReply::Done => ())
    }
    async fn force_unlock(&self, workers: &[WorkerId]) -> Result<u64, PgAdminError> {
        reply!(self, AdminRequest::ForceUnlock { workers: workers.to_vec() }, AdminReply::Released { tasks } => tasks)
    }
    async fn remove_key(&self, key: &str) -> Result<KeyRemoval, PgAdminError> {
        reply!(self, AdminRequest::RemoveKey { key: key.to_owned() }, AdminReply::KeyRemoved { removal } => removal)
    }
    async fn purge_finished(&self, retention_ms: u64, batch: u32) -> Result<u64, PgAdminError> {
        reply!(self, AdminRequest::Purge { retention_ms, batch }, AdminReply::Purged { tasks } => tasks)
    }
    async fn pause_queue(&self, queue: &str) -> Result<bool, PgAdminError> {
        reply!(self, AdminRequest::Pause { queue: queue.to_owned() }, AdminReply::Paused { was_running } => was_running)
    }
    async fn resume_queue(&self, queue: &str) -> Result<bool, PgAdminError> {
        reply!(self, AdminRequest::Resume { queue: queue.to_owned() }, AdminReply::Resumed { was_paused } => was_paused)
    }
}
