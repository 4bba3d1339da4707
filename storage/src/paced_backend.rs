//! A backend that paces each drive's reads to a fixed rate, as a real drive's bandwidth
//! limits them: a read completes no sooner than the drive could have transferred it after
//! the reads queued before it, and time the drive sat idle earns no credit.
//!
//! For benchmarks on emulated drives. The cgroup blkio throttle those use accounts in slices
//! of up to 100 ms and credits a slice's idle time to the next read: on this machine 16 MiB
//! reads after 20 ms pauses completed at twice a 400 MiB/s throttle, so a run that leaves the
//! drive idle while it computes looks faster there than on a real drive of that rate.
//! Drives are told apart by the device the file is on (`st_dev`), so every file of one
//! mount shares one drive's timeline.

use std::collections::HashMap;
use std::fmt::Debug;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backend::{IoBackend, IoFile};

/// When one drive finishes the transfers queued on it so far.
type DriveTimeline = Arc<Mutex<Instant>>;

/// Wraps a backend and paces every drive's reads to `bytes_per_s`.
#[derive(Debug)]
pub struct PacedBackend {
    inner: Arc<dyn IoBackend>,
    bytes_per_s: f64,
    drives: Mutex<HashMap<u64, DriveTimeline>>,
}

impl PacedBackend {
    /// `bytes_per_s` per drive; it must be positive and finite.
    pub fn new(inner: Arc<dyn IoBackend>, bytes_per_s: f64) -> io::Result<PacedBackend> {
        if !(bytes_per_s.is_finite() && bytes_per_s > 0.0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("paced drive rate must be positive, got {bytes_per_s} B/s"),
            ));
        }
        Ok(PacedBackend {
            inner,
            bytes_per_s,
            drives: Mutex::new(HashMap::new()),
        })
    }

    fn timeline(&self, path: &Path) -> io::Result<DriveTimeline> {
        let dev = std::fs::metadata(path)?.dev();
        let mut drives = self.drives.lock().unwrap_or_else(|p| p.into_inner());
        Ok(drives
            .entry(dev)
            .or_insert_with(|| Arc::new(Mutex::new(Instant::now())))
            .clone())
    }
}

#[derive(Debug)]
struct PacedFile {
    inner: Arc<dyn IoFile>,
    bytes_per_s: f64,
    drive: DriveTimeline,
}

impl IoFile for PacedFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let issued = Instant::now();
        let n = self.inner.read_at(buf, offset)?;
        let transfer = Duration::from_secs_f64(n as f64 / self.bytes_per_s);
        let done = {
            let mut free_at = self.drive.lock().unwrap_or_else(|p| p.into_inner());
            // An idle drive starts this transfer when it was asked for, not earlier.
            *free_at = (*free_at).max(issued) + transfer;
            *free_at
        };
        let now = Instant::now();
        crate::timeline::record("pace_inner", issued, now, n as u64, 0);
        if done > now {
            tight_timer_slack();
            std::thread::sleep(done - now);
            crate::timeline::record("pace_sleep", done, Instant::now(), 0, 0);
        }
        Ok(n)
    }

    fn is_direct(&self) -> bool {
        self.inner.is_direct()
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_all_at(buf, offset)
    }
}

thread_local! {
    static TIGHT_SLACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Wake this thread's sleeps on time. Linux lets a sleep overrun by the thread's timer slack
/// (50 us by default), and every paced read ends in a sleep: the emulated drive's reads
/// landed a median 75 us after their transfer ended (session 25's timeline), a delay of the
/// emulation that a real drive, whose reads complete by interrupt, does not have.
fn tight_timer_slack() {
    TIGHT_SLACK.with(|set| {
        if !set.get() {
            #[cfg(target_os = "linux")]
            // SAFETY: PR_SET_TIMERSLACK takes an integer argument and changes only this
            // thread's timer slack; it touches no memory of ours.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
            }
            set.set(true);
        }
    });
}

impl IoBackend for PacedBackend {
    fn open(&self, path: &Path) -> io::Result<Arc<dyn IoFile>> {
        Ok(Arc::new(PacedFile {
            inner: self.inner.open(path)?,
            bytes_per_s: self.bytes_per_s,
            drive: self.timeline(path)?,
        }))
    }

    fn open_for_repair(&self, path: &Path) -> io::Result<Arc<dyn IoFile>> {
        self.inner.open_for_repair(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::PosixBackend;

    fn file_of(dir: &Path, name: &str, len: usize) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, vec![7u8; len]).unwrap();
        p
    }

    #[test]
    fn rejects_a_rate_that_is_not_positive() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(PacedBackend::new(Arc::new(PosixBackend::default()), bad).is_err());
        }
    }

    #[test]
    fn reads_of_one_drive_share_its_rate_and_idle_time_earns_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let a = file_of(dir.path(), "a", 1 << 20);
        let b = file_of(dir.path(), "b", 1 << 20);
        // 1 MiB at 20 MiB/s: 50 ms a read.
        let paced = PacedBackend::new(
            Arc::new(PosixBackend { buffered: true }),
            20.0 * (1 << 20) as f64,
        )
        .unwrap();
        let (fa, fb) = (paced.open(&a).unwrap(), paced.open(&b).unwrap());
        let mut buf = vec![0u8; 1 << 20];
        // Two files on one device, read from two threads at once: 100 ms in all.
        let t = Instant::now();
        std::thread::scope(|s| {
            let fb = fb.clone();
            s.spawn(move || {
                let mut b2 = vec![0u8; 1 << 20];
                assert_eq!(fb.read_at(&mut b2, 0).unwrap(), 1 << 20);
            });
            assert_eq!(fa.read_at(&mut buf, 0).unwrap(), 1 << 20);
        });
        let both = t.elapsed();
        assert!(both >= Duration::from_millis(95), "two reads took {both:?}");
        // After a pause longer than a read, the next read still takes its full time.
        std::thread::sleep(Duration::from_millis(120));
        let t = Instant::now();
        fa.read_at(&mut buf, 0).unwrap();
        let after_idle = t.elapsed();
        assert!(
            after_idle >= Duration::from_millis(48),
            "a read after idle took {after_idle:?}"
        );
        assert!(buf.iter().all(|&v| v == 7));
    }
}
