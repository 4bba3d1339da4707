//! indicatif progress bars behind the storage crate's `Progress` trait.

use deltafin_storage::layout::Progress;
use indicatif::{ProgressBar, ProgressStyle};

/// A byte-counting bar (bytes, rate, ETA). Hidden when stderr is not a terminal or `quiet`.
#[derive(Debug)]
pub struct Bar {
    bar: ProgressBar,
}

impl Bar {
    pub fn new(quiet: bool) -> Bar {
        let bar = if quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(0)
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{msg:>12} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        Bar { bar }
    }
}

impl Progress for Bar {
    fn start(&self, total_bytes: u64, what: &str) {
        self.bar.set_length(total_bytes);
        self.bar.set_position(0);
        self.bar.set_message(what.to_string());
    }
    fn advance(&self, bytes: u64) {
        self.bar.inc(bytes);
    }
    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
