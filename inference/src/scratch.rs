//! Reused buffers for a forward pass's intermediates (expert products, their transposed
//! scratch, activations).
//!
//! A prefill chunk's routed experts make some 500 short-lived vectors per layer (each
//! expert's gate/up outputs, its activation, its down outputs, the `[rows, n]` scratch of
//! every matrix product). Allocating and zeroing them on the forward thread, while the other
//! threads wait for the next pass, was ~10% of that thread's prefill time
//! (`__memset`, `_int_malloc`, `_int_free`, `unlink_chunk`; benches/results, session 38).
//! A [`Scratch`] is taken from a shelf of returned buffers (the smallest that holds it) and
//! goes back on drop; its values are whatever the last user left, because every user here
//! writes each value before reading it.
//!
//! That promise is checked: with debug assertions (the test profile) every buffer handed out,
//! reused or new, is filled with a poison value first (NaN for `f32`, -128 for the 8-bit
//! planes, a value their quantizer never makes), so a value read before it is written turns
//! the fixtures' logits to NaN (or far off) instead of passing silently.

use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

/// Bytes of returned buffers a shelf keeps at most (per element type); a buffer returned
/// beyond it is freed. A 512-token prefill chunk of a hidden-7168 model has ~60 MB of
/// expert intermediates in flight per layer.
const SHELF_BYTES: usize = 256 << 20;

/// Buffers of one element type, by length (each buffer's whole length is initialised: a
/// [`Scratch`] shows a prefix of it).
#[derive(Debug)]
pub struct Shelf<T> {
    by_len: BTreeMap<usize, Vec<Vec<T>>>,
    bytes: usize,
}

impl<T> Shelf<T> {
    const fn new() -> Self {
        Shelf {
            by_len: BTreeMap::new(),
            bytes: 0,
        }
    }

    /// The shortest buffer of `len` to `2 * len` values, if one is kept (a longer one stays
    /// for the longer requests it suits: a decode step would take a prefill's buffers).
    fn take(&mut self, len: usize) -> Option<Vec<T>> {
        let (&key, list) = self.by_len.range_mut(len..=len.saturating_mul(2)).next()?;
        let v = list.pop()?;
        if list.is_empty() {
            self.by_len.remove(&key);
        }
        self.bytes -= key * size_of::<T>();
        Some(v)
    }

    fn put(&mut self, v: Vec<T>) {
        let bytes = v.len() * size_of::<T>();
        if v.is_empty() || self.bytes + bytes > SHELF_BYTES {
            return;
        }
        self.bytes += bytes;
        self.by_len.entry(v.len()).or_default().push(v);
    }
}

/// Element types a [`Scratch`] holds: each has its shelf and a poison value.
pub trait Recyclable: Copy + Default + Send + 'static {
    /// What a reused buffer is filled with under debug assertions.
    const POISON: Self;
    /// This type's shelf.
    fn shelf() -> &'static Mutex<Shelf<Self>>;
}

macro_rules! recyclable {
    ($t:ty, $poison:expr) => {
        impl Recyclable for $t {
            const POISON: Self = $poison;
            fn shelf() -> &'static Mutex<Shelf<Self>> {
                static SHELF: Mutex<Shelf<$t>> = Mutex::new(Shelf::new());
                &SHELF
            }
        }
    };
}

recyclable!(f32, f32::NAN);
// 8-bit quantized inputs have no NaN: -128 lies outside their -127..=127 range, so a
// byte read before it is written shows as a value the quantizer never makes.
recyclable!(i8, i8::MIN);

fn lock<T: Recyclable>() -> MutexGuard<'static, Shelf<T>> {
    // A panic while a shelf is held cannot leave it inconsistent for a later user (a
    // buffer is either on it or not), so a poisoned lock is taken as it is.
    T::shelf().lock().unwrap_or_else(|e| e.into_inner())
}

/// `len` values of a reused buffer: see the module docs. Derefs to a slice of exactly `len`.
pub struct Scratch<T: Recyclable> {
    buf: Vec<T>,
    len: usize,
}

impl<T: Recyclable> Scratch<T> {
    /// `len` values to be overwritten before they are read: their contents are unspecified
    /// (poison under debug assertions).
    pub fn for_overwrite(len: usize) -> Self {
        let reused = if len == 0 {
            None
        } else {
            lock::<T>().take(len)
        };
        let buf = match reused {
            Some(mut v) => {
                if cfg!(debug_assertions) {
                    v[..len].fill(T::POISON);
                }
                v
            }
            // New buffers are poisoned too under debug assertions: a first use that read
            // before writing would otherwise see zeros and pass.
            None if cfg!(debug_assertions) => vec![T::POISON; len],
            None => vec![T::default(); len],
        };
        Scratch { buf, len }
    }

    /// Adopts `v` (its values as they are); it goes on the shelf when dropped.
    pub fn from_vec(v: Vec<T>) -> Self {
        Scratch {
            len: v.len(),
            buf: v,
        }
    }

    /// The values as a vector of exactly `len` (leaves the shelf's cycle).
    pub fn into_vec(mut self) -> Vec<T> {
        let mut v = std::mem::take(&mut self.buf);
        v.truncate(self.len);
        v
    }
}

impl<T: Recyclable> Deref for Scratch<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[..self.len]
    }
}

impl<T: Recyclable> DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[..self.len]
    }
}

impl<T: Recyclable> Drop for Scratch<T> {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if !buf.is_empty() {
            lock::<T>().put(buf);
        }
    }
}

impl<T: Recyclable> Default for Scratch<T> {
    /// No values (nothing to put back).
    fn default() -> Self {
        Scratch::from_vec(Vec::new())
    }
}

impl<'a, T: Recyclable> IntoIterator for &'a Scratch<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: Recyclable + std::fmt::Debug> std::fmt::Debug for Scratch<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shelf_gives_the_shortest_buffer_that_holds_the_request() {
        let mut s = Shelf::<f32>::new();
        s.put(vec![1.0; 8]);
        s.put(vec![2.0; 32]);
        s.put(vec![3.0; 16]);
        assert_eq!(s.bytes, 56 * 4);
        assert_eq!(s.take(9).map(|v| v.len()), Some(16));
        assert_eq!(s.take(8).map(|v| v.len()), Some(8));
        assert_eq!(s.take(33), None);
        // At most twice the request: 32 values are kept for a longer one.
        assert_eq!(s.take(15), None);
        assert_eq!(s.take(16).map(|v| v.len()), Some(32));
        assert_eq!((s.bytes, s.by_len.len()), (0, 0));
    }

    #[test]
    fn shelf_frees_what_is_over_its_cap() {
        let mut s = Shelf::<i8>::new();
        s.put(vec![0; SHELF_BYTES]);
        s.put(vec![0; 1]);
        assert_eq!(s.bytes, SHELF_BYTES);
        assert_eq!(s.take(1), None);
        assert_eq!(s.take(SHELF_BYTES).map(|v| v.len()), Some(SHELF_BYTES));
        assert_eq!(s.take(SHELF_BYTES), None);
    }

    #[test]
    fn scratch_shows_its_length_and_reused_values_are_poisoned() {
        // Private to this test: a length no other test asks for.
        let len = 1_000_003;
        {
            let mut a = Scratch::<f32>::for_overwrite(len);
            assert_eq!(a.len(), len);
            a.fill(7.0);
        }
        let b = Scratch::<f32>::for_overwrite(len - 1);
        assert_eq!(b.len(), len - 1);
        // Never the 7s left behind: under debug assertions (the test profile) reused and new
        // buffers alike are poisoned (a test running alongside may have taken that one).
        if cfg!(debug_assertions) {
            assert!(b.iter().all(|v| v.is_nan()));
        }
        let v = b.into_vec();
        assert_eq!(v.len(), len - 1);
        assert!(Scratch::<f32>::from_vec(Vec::new()).is_empty());
    }
}
