//! [`Repair`]: one range of a drive rewritten from a good copy (or that could not be), as
//! reported to the caller and logged in the drive's layout folder.

use std::path::PathBuf;

/// The file in each drive's layout folder where repairs are logged, one line each.
pub const REPAIR_LOG_FILE: &str = "repair.log";

/// One range rewritten from a good copy (or that could not be).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Repair {
    /// The drive whose copy was bad.
    pub drive: usize,
    /// Its data file.
    pub path: PathBuf,
    pub offset: u64,
    pub len: u64,
    /// What the range holds (`layer 3 expert 7`).
    pub what: String,
    /// The drive whose copy matched the hash.
    pub from_drive: usize,
    /// `None`: rewritten and read back equal; else why the repair failed (the bad copy stays
    /// bad, and reads keep going to the good ones).
    pub error: Option<String>,
}

impl std::fmt::Display for Repair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.error {
            None => write!(
                f,
                "drive {} ({}) offset {}, {} bytes ({}): corrupt copy rewritten from drive {}",
                self.drive,
                self.path.display(),
                self.offset,
                self.len,
                self.what,
                self.from_drive
            ),
            Some(e) => write!(
                f,
                "drive {} ({}) offset {}, {} bytes ({}): corrupt copy NOT repaired ({e}); \
                 served from drive {}",
                self.drive,
                self.path.display(),
                self.offset,
                self.len,
                self.what,
                self.from_drive
            ),
        }
    }
}
