//! [`WeightBytes`]: a resident matrix's bytes, either its own copy or a range of a buffer the
//! weight source shares (a layout's resident record), so loading a model from a layout does not
//! hold every resident weight twice.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// A buffer a weight source can share with the model (held as long as any matrix uses it).
pub type SharedBuffer = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Bytes of a resident matrix.
#[derive(Clone)]
pub enum WeightBytes {
    Owned(Vec<u8>),
    /// `range` of a shared buffer.
    Shared {
        buffer: SharedBuffer,
        range: Range<usize>,
    },
}

impl WeightBytes {
    /// `range` of `buffer`, or `None` when the range does not lie inside it.
    pub fn shared(buffer: SharedBuffer, range: Range<usize>) -> Option<WeightBytes> {
        let len = (*buffer).as_ref().len();
        (range.start <= range.end && range.end <= len)
            .then_some(WeightBytes::Shared { buffer, range })
    }

    pub fn as_slice(&self) -> &[u8] {
        match self {
            WeightBytes::Owned(v) => v,
            // The range was checked against the buffer when this was made, and a shared buffer
            // never changes length (it is behind an `Arc` with no mutable access).
            WeightBytes::Shared { buffer, range } => {
                (**buffer).as_ref().get(range.clone()).unwrap_or(&[])
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            WeightBytes::Owned(v) => v.len(),
            WeightBytes::Shared { range, .. } => range.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the bytes are a range of a shared buffer (not a copy).
    pub fn is_shared(&self) -> bool {
        matches!(self, WeightBytes::Shared { .. })
    }
}

impl fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightBytes::Owned(v) => write!(f, "Owned({} bytes)", v.len()),
            WeightBytes::Shared { range, .. } => write!(f, "Shared({range:?})"),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_range_reads_its_part_of_the_buffer() {
        let buf: SharedBuffer = Arc::new(vec![1u8, 2, 3, 4, 5]);
        let b = WeightBytes::shared(buf.clone(), 1..4).unwrap();
        assert_eq!(b.as_slice(), &[2, 3, 4]);
        assert_eq!(b.len(), 3);
        assert!(b.is_shared());
        assert!(WeightBytes::shared(buf.clone(), 2..6).is_none());
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 3..1;
        assert!(WeightBytes::shared(buf, backwards).is_none());
        assert_eq!(WeightBytes::Owned(vec![9]).as_slice(), &[9]);
    }
}
