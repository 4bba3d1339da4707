//! The hash a record's bytes are checked against as they land.
//!
//! A layout's manifest carries two hashes per record: blake3 (the layout's authority: `verify`,
//! the content hash, repairs) and, from manifest version 3, XXH3-128. Reads check XXH3-128:
//! it runs at memory speed (~10 GB/s on one Zen 2 core, 3.5x blake3's 2.9 GB/s), and every
//! byte a decode token streams is hashed on the same cores that compute it. Both catch any
//! accidental change (a miss has probability 2^-128); neither is a signature (the manifest
//! that holds them is unkeyed), so the faster one loses nothing. Version 2 manifests have no
//! XXH3 and are checked with blake3.
//!
//! XXH3 comes from `twox-hash`, which picks its AVX2 / NEON code at run time; `xxhash-rust`
//! (used before, and kept as the test oracle) picks SSE2 at compile time on x86_64 builds for
//! any CPU. On a Zen 3 core, in cache: 35-38 GB/s against 18-19.

use twox_hash::XxHash3_128 as Xxh3;

/// XXH3-128 of `bytes` (default secret, seed 0), as the manifest stores it.
pub fn xxh3_128(bytes: &[u8]) -> u128 {
    Xxh3::oneshot(bytes)
}

/// What a landed record must hash to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordHash {
    Xxh3(u128),
    Blake3([u8; 32]),
}

impl RecordHash {
    /// The check for a record whose manifest entry holds `blake3_hex` and `xxh3_hex`: the
    /// XXH3-128 when there is one, else the blake3. `None` if the hex does not parse
    /// (manifest validation refuses such entries before this).
    pub fn from_manifest_hex(blake3_hex: &str, xxh3_hex: Option<&str>) -> Option<RecordHash> {
        match xxh3_hex {
            Some(h) => parse_xxh3_hex(h).map(RecordHash::Xxh3),
            None => blake3::Hash::from_hex(blake3_hex)
                .ok()
                .map(|h| RecordHash::Blake3(*h.as_bytes())),
        }
    }

    /// True when `bytes` hash to this value.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        match self {
            RecordHash::Xxh3(want) => xxh3_128(bytes) == *want,
            RecordHash::Blake3(want) => blake3::hash(bytes) == blake3::Hash::from_bytes(*want),
        }
    }

    /// A check fed the bytes in order, for [`HashStream::matches`] against this value.
    pub fn stream(&self) -> HashStream {
        match self {
            RecordHash::Xxh3(_) => HashStream::Xxh3(Box::new(Xxh3::new())),
            RecordHash::Blake3(_) => HashStream::Blake3(Box::default()),
        }
    }

    /// Which function this is, for reports.
    pub fn algorithm(&self) -> &'static str {
        match self {
            RecordHash::Xxh3(_) => "xxh3-128",
            RecordHash::Blake3(_) => "blake3",
        }
    }
}

/// One record's check computed as its bytes arrive in order ([`RecordHash::stream`]).
pub enum HashStream {
    Xxh3(Box<Xxh3>),
    Blake3(Box<blake3::Hasher>),
}

impl std::fmt::Debug for HashStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HashStream").finish_non_exhaustive()
    }
}

impl HashStream {
    pub fn update(&mut self, bytes: &[u8]) {
        match self {
            HashStream::Xxh3(h) => h.write(bytes),
            HashStream::Blake3(h) => {
                h.update(bytes);
            }
        }
    }

    /// True when the bytes fed so far hash to `want` (of the same function).
    pub fn matches(&self, want: &RecordHash) -> bool {
        match (self, want) {
            (HashStream::Xxh3(h), RecordHash::Xxh3(w)) => h.finish_128() == *w,
            (HashStream::Blake3(h), RecordHash::Blake3(w)) => {
                h.finalize() == blake3::Hash::from_bytes(*w)
            }
            _ => false,
        }
    }
}

/// XXH3-128 as the manifest writes it: 32 lowercase hex digits, most significant first.
pub fn xxh3_hex(value: u128) -> String {
    format!("{value:032x}")
}

/// The inverse of [`xxh3_hex`]; `None` unless exactly 32 hex digits.
pub fn parse_xxh3_hex(s: &str) -> Option<u128> {
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(s, 16).ok()
}

/// Both of a record's hashes, fed as its bytes are written or read in order.
pub struct RecordHasher {
    blake3: blake3::Hasher,
    xxh3: Xxh3,
}

impl std::fmt::Debug for RecordHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordHasher").finish_non_exhaustive()
    }
}

impl Default for RecordHasher {
    fn default() -> Self {
        RecordHasher {
            blake3: blake3::Hasher::new(),
            xxh3: Xxh3::new(),
        }
    }
}

impl RecordHasher {
    pub fn new() -> RecordHasher {
        RecordHasher::default()
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.blake3.update(bytes);
        self.xxh3.write(bytes);
    }

    /// (blake3 hex, XXH3-128 hex) of everything fed; the hasher starts over.
    pub fn finish(&mut self) -> (String, String) {
        let b = std::mem::take(&mut self.blake3)
            .finalize()
            .to_hex()
            .to_string();
        let x = xxh3_hex(std::mem::replace(&mut self.xxh3, Xxh3::new()).finish_128());
        (b, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `twox-hash` against `xxhash-rust` (the implementation manifests were written with
    /// before): one-shot and streamed in uneven pieces, at every length around XXH3's
    /// internal boundaries (16, 128, 240 bytes, 64-byte stripes, 1 KiB blocks) and at a
    /// record's size. A difference would fail every existing layout's reads.
    #[test]
    fn xxh3_128_equals_the_reference_implementation() {
        let bytes: Vec<u8> = (0..(3 << 20) + 17u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        let lens = (0..=2100).chain([4095, 4096, 4097, 65_536, 1 << 20, bytes.len()]);
        for len in lens {
            let b = &bytes[..len];
            let want = xxhash_rust::xxh3::xxh3_128(b);
            assert_eq!(xxh3_128(b), want, "one-shot, {len} bytes");
            let mut stream = RecordHash::Xxh3(want).stream();
            for piece in b.chunks(len / 3 + 1) {
                stream.update(piece);
            }
            assert!(
                stream.matches(&RecordHash::Xxh3(want)),
                "streamed, {len} bytes"
            );
        }
    }

    /// (blake3 hex, XXH3-128 hex) of `bytes`, fed in uneven pieces as a record is written.
    fn hexes(bytes: &[u8]) -> (String, String) {
        let mut h = RecordHasher::new();
        for c in bytes.chunks(1000) {
            h.update(c);
        }
        h.finish()
    }

    #[test]
    fn streamed_hashes_equal_one_shot_and_any_flipped_bit_fails() {
        let bytes: Vec<u8> = (0..70_001u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let (b, x) = hexes(&bytes);
        for with_xxh3 in [true, false] {
            let check = RecordHash::from_manifest_hex(&b, with_xxh3.then_some(x.as_str())).unwrap();
            assert_eq!(
                check.algorithm(),
                if with_xxh3 { "xxh3-128" } else { "blake3" }
            );
            assert!(check.matches(&bytes));
            for pos in [0, 1, 4095, 4096, 35_000, bytes.len() - 1] {
                for bit in [0, 7] {
                    let mut bad = bytes.clone();
                    bad[pos] ^= 1 << bit;
                    assert!(!check.matches(&bad), "{with_xxh3} {pos} {bit}");
                }
            }
            assert!(!check.matches(&bytes[..bytes.len() - 1]));
        }
        for with_xxh3 in [true, false] {
            let check = RecordHash::from_manifest_hex(&b, with_xxh3.then_some(x.as_str())).unwrap();
            let mut s = check.stream();
            for c in bytes.chunks(4096 * 3 + 1) {
                s.update(c);
            }
            assert!(s.matches(&check), "{with_xxh3}");
            s.update(&[0]);
            assert!(!s.matches(&check), "{with_xxh3}: a byte more");
        }
        assert_eq!(b, blake3::hash(&bytes).to_hex().to_string());
        assert_eq!(x, xxh3_hex(xxh3_128(&bytes)));
        assert_eq!(RecordHash::from_manifest_hex("zz", None), None);
        assert_eq!(RecordHash::from_manifest_hex(&b, Some("zz")), None);
    }

    #[test]
    fn hex_round_trips_and_refuses_malformed() {
        for v in [
            0u128,
            1,
            u128::MAX,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        ] {
            assert_eq!(parse_xxh3_hex(&xxh3_hex(v)), Some(v));
        }
        for s in [
            "",
            "0",
            &"0".repeat(31),
            &"0".repeat(33),
            &"g".repeat(32),
            "+0000000000000000000000000000000",
        ] {
            assert_eq!(parse_xxh3_hex(s), None, "{s}");
        }
    }
}
