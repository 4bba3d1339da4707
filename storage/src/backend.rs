//! The swappable I/O backend: how a data file is opened and read at an offset, and opened for
//! writing when a bad copy is repaired.
//!
//! [`PosixBackend`] is the real one (O_DIRECT `pread`, falling back to buffered reads with
//! `posix_fadvise(DONTNEED)` where the filesystem refuses O_DIRECT; `pwrite` + `fdatasync`
//! for repairs). [`FaultyBackend`] wraps any backend to inject short reads, I/O errors,
//! corruption, latency and a drive that goes away, in tests.

use std::fmt::Debug;
use std::io;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// An open data file.
pub trait IoFile: Send + Sync + Debug {
    /// Read up to `buf.len()` bytes at `offset`; may return fewer (short read) or 0 at EOF.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    /// True when reads bypass the page cache.
    fn is_direct(&self) -> bool;
    /// Write all of `buf` at `offset` and make it durable (files opened with
    /// [`IoBackend::open_for_repair`]); read-only files refuse.
    fn write_all_at(&self, _buf: &[u8], _offset: u64) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "opened read-only",
        ))
    }
}

/// Opens data files.
pub trait IoBackend: Send + Sync + Debug {
    fn open(&self, path: &Path) -> io::Result<Arc<dyn IoFile>>;
    /// Open a data file for rewriting bad ranges from a good copy. The default refuses.
    fn open_for_repair(&self, path: &Path) -> io::Result<Arc<dyn IoFile>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("{}: this backend cannot write", path.display()),
        ))
    }
}

/// Real files: O_DIRECT where the filesystem allows it.
#[derive(Debug, Default, Clone, Copy)]
pub struct PosixBackend {
    /// Skip O_DIRECT entirely (buffered reads, still dropping pages after use).
    pub buffered: bool,
}

#[derive(Debug)]
struct PosixFile {
    file: std::fs::File,
    direct: bool,
}

impl IoBackend for PosixBackend {
    fn open(&self, path: &Path) -> io::Result<Arc<dyn IoFile>> {
        use std::os::unix::fs::OpenOptionsExt;
        if !self.buffered {
            match std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
            {
                Ok(file) => return Ok(Arc::new(PosixFile { file, direct: true })),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {} // e.g. tmpfs: fall back
                Err(e) => return Err(e),
            }
        }
        let file = std::fs::File::open(path)?;
        Ok(Arc::new(PosixFile {
            file,
            direct: false,
        }))
    }

    fn open_for_repair(&self, path: &Path) -> io::Result<Arc<dyn IoFile>> {
        // Buffered: repairs are rare and small; fdatasync makes them durable, and a later
        // O_DIRECT read of the range sees them (the kernel writes back overlapping pages first).
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        Ok(Arc::new(PosixFile {
            file,
            direct: false,
        }))
    }
}

impl IoFile for PosixFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let off = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset past off_t"))?;
        loop {
            // SAFETY: buf is a valid writable region of buf.len() bytes for the call's duration.
            let n = unsafe {
                libc::pread(
                    self.file.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    off,
                )
            };
            if n >= 0 {
                if !self.direct && n > 0 {
                    // Buffered fallback: drop the pages so reads measure the drive, not RAM,
                    // and the page cache does not grow past the RAM budget. Advisory only.
                    // SAFETY: plain syscall on an fd we own.
                    unsafe {
                        libc::posix_fadvise(
                            self.file.as_raw_fd(),
                            off,
                            n as libc::off_t,
                            libc::POSIX_FADV_DONTNEED,
                        );
                    }
                }
                return Ok(n as usize);
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }

    fn is_direct(&self) -> bool {
        self.direct
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(buf, offset)?;
        self.file.sync_data()
    }
}

/// One fault to inject.
#[derive(Debug, Clone)]
pub enum Fault {
    /// Reads of files whose path contains `path_contains` that cover `offset` fail with EIO.
    Eio { path_contains: String, offset: u64 },
    /// Every read returns at most half the bytes asked (at least 512), exercising retry loops.
    ShortReads,
    /// Every read sleeps this long first.
    Latency(Duration),
    /// Reads of files whose path contains `path_contains` sleep this long first (a slow drive).
    SlowPath {
        path_contains: String,
        delay: Duration,
    },
    /// Reads of matching files see this byte flipped (silent corruption).
    FlipByte { path_contains: String, offset: u64 },
    /// Record the offset of every read, in the order reads start ([`FaultyBackend::read_log`]).
    LogReads,
    /// Reads of matching files return stale data: the bytes of the same range
    /// `shift` bytes earlier in the file (a torn or misdirected write).
    Stale {
        path_contains: String,
        offset: u64,
        shift: u64,
    },
    /// The drive holding matching files goes away after `after_reads` reads through this
    /// backend in total (every later read, and any repair write, fails with ENODEV).
    Gone {
        path_contains: String,
        after_reads: u64,
    },
}

/// Wraps a backend and injects [`Fault`]s.
#[derive(Debug)]
pub struct FaultyBackend {
    pub inner: Arc<dyn IoBackend>,
    pub faults: Vec<Fault>,
    /// How many reads hit an injected fault.
    pub hits: Arc<AtomicU64>,
    /// With [`Fault::LogReads`]: every read's file offset, in the order reads started.
    pub read_log: Arc<std::sync::Mutex<Vec<u64>>>,
    /// Reads through this backend so far (all files).
    pub reads: Arc<AtomicU64>,
}

impl FaultyBackend {
    pub fn new(inner: Arc<dyn IoBackend>, faults: Vec<Fault>) -> FaultyBackend {
        FaultyBackend {
            inner,
            faults,
            hits: Arc::new(AtomicU64::new(0)),
            read_log: Arc::default(),
            reads: Arc::new(AtomicU64::new(0)),
        }
    }
}

#[derive(Debug)]
struct FaultyFile {
    inner: Arc<dyn IoFile>,
    path: String,
    faults: Vec<Fault>,
    hits: Arc<AtomicU64>,
    read_log: Arc<std::sync::Mutex<Vec<u64>>>,
    reads: Arc<AtomicU64>,
}

impl IoBackend for FaultyBackend {
    fn open(&self, path: &Path) -> io::Result<Arc<dyn IoFile>> {
        Ok(Arc::new(FaultyFile {
            inner: self.inner.open(path)?,
            path: path.display().to_string(),
            faults: self.faults.clone(),
            hits: self.hits.clone(),
            read_log: self.read_log.clone(),
            reads: self.reads.clone(),
        }))
    }

    /// Repairs write through the inner backend, faults and all (a drive that has gone away
    /// refuses writes too).
    fn open_for_repair(&self, path: &Path) -> io::Result<Arc<dyn IoFile>> {
        if self.gone(&path.display().to_string()) {
            return Err(io::Error::from_raw_os_error(libc::ENODEV));
        }
        self.inner.open_for_repair(path)
    }
}

impl FaultyBackend {
    /// Whether a [`Fault::Gone`] drive matching `path` has gone away by now.
    fn gone(&self, path: &str) -> bool {
        self.faults.iter().any(|f| match f {
            Fault::Gone {
                path_contains,
                after_reads,
            } => {
                path.contains(path_contains.as_str())
                    && self.reads.load(Ordering::Relaxed) >= *after_reads
            }
            _ => false,
        })
    }
}

impl IoFile for FaultyFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let covers = |o: u64| o >= offset && o < offset + buf.len() as u64;
        let mut limit = buf.len();
        let done = self.reads.fetch_add(1, Ordering::Relaxed);
        for f in &self.faults {
            match f {
                Fault::Gone {
                    path_contains,
                    after_reads,
                } if self.path.contains(path_contains.as_str()) && done >= *after_reads => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Err(io::Error::from_raw_os_error(libc::ENODEV));
                }
                Fault::Stale {
                    path_contains,
                    offset: o,
                    shift,
                } if self.path.contains(path_contains.as_str())
                    && covers(*o)
                    && offset >= *shift =>
                {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return self.inner.read_at(&mut buf[..limit], offset - shift);
                }
                Fault::Eio {
                    path_contains,
                    offset: o,
                } if self.path.contains(path_contains.as_str()) && covers(*o) => {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Err(io::Error::from_raw_os_error(libc::EIO));
                }
                Fault::ShortReads => limit = (buf.len() / 2).max(512).min(buf.len()),
                Fault::LogReads => self
                    .read_log
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(offset),
                Fault::Latency(d) => std::thread::sleep(*d),
                Fault::SlowPath {
                    path_contains,
                    delay,
                } if self.path.contains(path_contains.as_str()) => std::thread::sleep(*delay),
                _ => {}
            }
        }
        let n = self.inner.read_at(&mut buf[..limit], offset)?;
        for f in &self.faults {
            if let Fault::FlipByte {
                path_contains,
                offset: o,
            } = f
            {
                if self.path.contains(path_contains.as_str())
                    && *o >= offset
                    && *o < offset + n as u64
                {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    buf[(*o - offset) as usize] ^= 0xff;
                }
            }
        }
        Ok(n)
    }

    fn is_direct(&self) -> bool {
        self.inner.is_direct()
    }
}
