//! Time zones from the system's tz database: the I/O the pure [`schedule`](crate::schedule)
//! module leaves to its caller.

use std::path::PathBuf;

use crate::config::AppConfig;
use crate::schedule::{TimeZone, TzError, ZoneId};
use crate::scheduler::{Scheduler, SchedulerError};

/// Where zone files are read when `TZDIR` is not set.
pub const DEFAULT_ZONEINFO_DIR: &str = "/usr/share/zoneinfo";

/// Why a time zone could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZoneLoadError {
    /// The name is not a valid zone name, or the file is not valid TZif data.
    #[error(transparent)]
    Invalid(#[from] TzError),
    /// The zone's file could not be read.
    #[error("cannot read time zone file {path}: {error}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        error: std::io::Error,
    },
}

/// The directory zone files are read from: `$TZDIR`, else [`DEFAULT_ZONEINFO_DIR`].
pub fn zoneinfo_dir() -> PathBuf {
    std::env::var_os("TZDIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_ZONEINFO_DIR), PathBuf::from)
}

/// The zone `id`: UTC and fixed offsets are built in; a named zone is read from its TZif file
/// under [`zoneinfo_dir`] (the name was checked by [`ZoneId::parse`], so the path stays
/// inside that directory).
pub fn load_time_zone(id: &ZoneId) -> Result<TimeZone, ZoneLoadError> {
    if let Some(tz) = id.builtin() {
        return Ok(tz);
    }
    let name = id.to_string();
    let path = zoneinfo_dir().join(crate::schedule::zone_path(&name)?);
    let bytes = std::fs::read(&path).map_err(|error| ZoneLoadError::Read { path, error })?;
    Ok(TimeZone::from_tzif(&name, &bytes)?)
}

/// The scheduler of `app`'s schedules, with their zones read by [`load_time_zone`].
pub fn load_scheduler(app: &AppConfig) -> Result<Scheduler, SchedulerError> {
    Scheduler::from_app(app, |id| load_time_zone(id).map_err(|e| e.to_string()))
}
