//! Where the bytes of a layout's logical address space live on the drives.
//!
//! A layout is one logical byte space (records at 4 KiB-aligned offsets). In `replicate` mode
//! every drive's data file holds the whole space at the same offsets. In `stripe` mode the space
//! is cut into units of `unit` bytes and unit `i` lives on drive `i % n` at file offset
//! `(i / n) * unit` (RAID-0).

use serde::{Deserialize, Serialize};

/// Alignment of records, stripe units and O_DIRECT reads.
pub const ALIGN: u64 = 4096;

/// Placement mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Replicate,
    Stripe,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Replicate => "replicate",
            Mode::Stripe => "stripe",
        })
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "replicate" | "mirror" => Ok(Mode::Replicate),
            "stripe" => Ok(Mode::Stripe),
            other => Err(format!("unknown mode `{other}` (replicate or stripe)")),
        }
    }
}

/// A contiguous run of a logical range that sits contiguously on one drive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Drive index; in replicate mode any drive may serve it and this is 0.
    pub drive: usize,
    /// Byte offset in that drive's data file.
    pub file_offset: u64,
    /// Byte offset within the requested range (and so within the destination buffer).
    pub buf_offset: u64,
    pub len: u64,
}

/// The placement rule of one layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub mode: Mode,
    pub drives: usize,
    /// Stripe unit in bytes (a multiple of [`ALIGN`]); in replicate mode, the granularity of
    /// unit hashes and the largest single read.
    pub unit: u64,
}

impl Placement {
    pub fn new(mode: Mode, drives: usize, unit: u64) -> Result<Placement, String> {
        if drives == 0 {
            return Err("a layout needs at least one drive".into());
        }
        if unit == 0 || !unit.is_multiple_of(ALIGN) {
            return Err(format!(
                "stripe unit {unit} must be a positive multiple of {ALIGN}"
            ));
        }
        Ok(Placement { mode, drives, unit })
    }

    /// Drive and file offset of logical stripe unit `i`.
    pub fn unit_location(&self, i: u64) -> (usize, u64) {
        match self.mode {
            Mode::Replicate => (0, i * self.unit),
            Mode::Stripe => {
                let n = self.drives as u64;
                ((i % n) as usize, (i / n) * self.unit)
            }
        }
    }

    /// Number of units covering `logical_len` bytes.
    pub fn unit_count(&self, logical_len: u64) -> u64 {
        logical_len.div_ceil(self.unit)
    }

    /// Bytes drive `d`'s data file holds for a logical space of `logical_len` bytes.
    pub fn drive_file_len(&self, d: usize, logical_len: u64) -> u64 {
        match self.mode {
            Mode::Replicate => logical_len,
            Mode::Stripe => {
                let n = self.drives as u64;
                let units = self.unit_count(logical_len);
                let full = units / n;
                let rem = units % n;
                let mine = full + u64::from((d as u64) < rem);
                if mine == 0 {
                    return 0;
                }
                // The last unit overall may be short; it belongs to drive (units-1) % n.
                let last_drive = ((units - 1) % n) as usize;
                let tail_short = units * self.unit - logical_len;
                mine * self.unit - if d == last_drive { tail_short } else { 0 }
            }
        }
    }

    /// Split logical range `[offset, offset+len)` into per-unit pieces (each within one unit,
    /// so within one drive's contiguous run).
    pub fn pieces(&self, offset: u64, len: u64) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let unit_index = pos / self.unit;
            let within = pos % self.unit;
            let take = (self.unit - within).min(end - pos);
            let (drive, base) = self.unit_location(unit_index);
            out.push(Piece {
                drive,
                file_offset: base + within,
                buf_offset: pos - offset,
                len: take,
            });
            pos += take;
        }
        out
    }
}

/// Round `x` up to a multiple of [`ALIGN`].
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Write a logical space through the placement into per-drive files, read any range back.
    fn scatter(p: &Placement, data: &[u8]) -> Vec<Vec<u8>> {
        let mut drives = vec![Vec::new(); p.drives];
        for piece in p.pieces(0, data.len() as u64) {
            let copies: Vec<usize> = if p.mode == Mode::Replicate {
                (0..p.drives).collect()
            } else {
                vec![piece.drive]
            };
            for d in copies {
                let f = &mut drives[d];
                let end = (piece.file_offset + piece.len) as usize;
                if f.len() < end {
                    f.resize(end, 0);
                }
                f[piece.file_offset as usize..end].copy_from_slice(
                    &data[piece.buf_offset as usize..(piece.buf_offset + piece.len) as usize],
                );
            }
        }
        drives
    }

    proptest! {
        #[test]
        fn reassembles_byte_exact(
            len in 1u64..200_000,
            units in 1u64..8,
            drives in 1usize..6,
            stripe in any::<bool>(),
            start_frac in 0.0f64..1.0,
            len_frac in 0.0f64..1.0,
            replica in 0usize..6,
        ) {
            let mode = if stripe { Mode::Stripe } else { Mode::Replicate };
            let p = Placement::new(mode, drives, units * ALIGN).unwrap();
            let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let files = scatter(&p, &data);
            for (d, f) in files.iter().enumerate() {
                prop_assert_eq!(f.len() as u64, p.drive_file_len(d, len));
            }
            let start = ((len as f64) * start_frac) as u64;
            let rlen = (((len - start) as f64) * len_frac) as u64;
            let mut out = vec![0u8; rlen as usize];
            let mut covered = 0;
            for piece in p.pieces(start, rlen) {
                let d = if mode == Mode::Replicate { replica % drives } else { piece.drive };
                let src = &files[d][piece.file_offset as usize..(piece.file_offset + piece.len) as usize];
                out[piece.buf_offset as usize..(piece.buf_offset + piece.len) as usize].copy_from_slice(src);
                covered += piece.len;
                prop_assert!(piece.len <= p.unit);
            }
            prop_assert_eq!(covered, rlen);
            prop_assert_eq!(&out[..], &data[start as usize..(start + rlen) as usize]);
        }
    }

    #[test]
    fn round_robin() {
        let p = Placement::new(Mode::Stripe, 4, ALIGN).unwrap();
        let ds: Vec<usize> = p.pieces(0, 6 * ALIGN).iter().map(|x| x.drive).collect();
        assert_eq!(ds, vec![0, 1, 2, 3, 0, 1]);
        assert_eq!(p.unit_location(5), (1, ALIGN));
        assert!(Placement::new(Mode::Stripe, 4, 1000).is_err());
        assert!(Placement::new(Mode::Stripe, 0, ALIGN).is_err());
    }
}
