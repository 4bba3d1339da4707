//! Instruction sets the kernels dispatch to, detected at run time, and the [`KernelConfig`] a
//! model is loaded with.

use std::sync::OnceLock;

use deltafin_formats::WeightFormat;

/// Instruction set used by the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust (the reference).
    Scalar,
    /// x86_64 AVX2 + FMA + F16C.
    Avx2,
    /// [`Isa::Avx2`] plus AVX-VNNI (Alder Lake and later, Zen 5): the AVX2 kernels with
    /// `vpdpbusd` for the 16-bit-activation path.
    AvxVnni,
    /// x86_64 AVX-512 F/BW/VL without VNNI on top of [`Isa::Avx2`] (Skylake-SP and other
    /// Intel CPUs with AVX-512 but no VNNI): the AVX-512 kernels, the 16-bit path's `vpdpbusd`
    /// made of `vpmaddubsw` / `vpmaddwd` (the same integers).
    Avx512Bw,
    /// x86_64 AVX-512 F/BW/VL/VNNI on top of [`Isa::Avx2`].
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Isa {
    /// Whether this machine can run `self`.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::AvxVnni => Isa::Avx2.available() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bw => {
                Isa::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Isa::Avx512Bw.available() && is_x86_feature_detected!("avx512vnni"),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The best instruction set this machine runs (no cap).
    pub fn best() -> Isa {
        [
            Isa::Avx512,
            Isa::Avx512Bw,
            Isa::AvxVnni,
            Isa::Avx2,
            Isa::Neon,
        ]
        .into_iter()
        .find(|i| i.available())
        .unwrap_or(Isa::Scalar)
    }

    /// The best available instruction set no higher than `cap` (the x86 sets in the order
    /// AVX2 < AVX-VNNI < AVX-512 without VNNI < AVX-512; `Scalar` caps everything).
    pub fn capped(cap: Isa) -> Isa {
        let rank = |i: Isa| match i {
            Isa::Scalar => 0,
            Isa::Avx2 => 1,
            Isa::AvxVnni => 2,
            Isa::Avx512Bw => 3,
            Isa::Avx512 => 4,
            Isa::Neon => 1,
        };
        [
            Isa::Avx512,
            Isa::Avx512Bw,
            Isa::AvxVnni,
            Isa::Avx2,
            Isa::Neon,
        ]
        .into_iter()
        .filter(|&i| cap != Isa::Scalar && rank(i) <= rank(cap))
        .find(|i| i.available())
        .unwrap_or(Isa::Scalar)
    }

    /// The instruction set [`KernelConfig::from_env`] picks: the best available, capped by
    /// `DELTAFIN_KERNELS=scalar|avx2|avxvnni|avx512bw`.
    pub fn detect() -> Isa {
        KernelConfig::from_env().isa
    }

    /// The names [`Isa::parse`] takes (`DELTAFIN_KERNELS`).
    pub const NAMES: [(&'static str, Isa); 6] = [
        ("scalar", Isa::Scalar),
        ("avx2", Isa::Avx2),
        ("avxvnni", Isa::AvxVnni),
        ("avx512bw", Isa::Avx512Bw),
        ("avx512", Isa::Avx512),
        ("neon", Isa::Neon),
    ];

    /// Parse one of [`Isa::NAMES`].
    pub fn parse(s: &str) -> Option<Isa> {
        Isa::NAMES
            .iter()
            .find(|(n, _)| *n == s)
            .map(|&(_, isa)| isa)
    }

    /// Whether the AVX2 kernels run on this ISA (AVX-512 machines run them too).
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn has_avx2(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::AvxVnni | Isa::Avx512Bw | Isa::Avx512)
    }

    /// Whether the AVX-512 kernels run on this ISA (with or without VNNI).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // used by the x86 kernels only
    pub(crate) fn has_avx512(self) -> bool {
        matches!(self, Isa::Avx512Bw | Isa::Avx512)
    }

    /// The kernels that run `kind` on `self`: `self` where this machine has it, else the
    /// portable ones; except that AVX-512 without VNNI hands Q8 to the AVX2 kernels:
    /// they widen the codes to 16 bits once and meet the 16-bit inputs in `vpmaddwd`, where
    /// the AVX-512 tile emulates `vpdpbusd` twice per code vector (two input planes), about
    /// three times the operations. On Zen 4 capped to AVX-512 BW the AVX2 Q8 kernels ran 1.4x
    /// as fast from two inputs up and no slower at one (benches/results/isa_sweep_session29*).
    /// The AVX-512 tiles keep INT4 and MXFP4, whose small codes sum in i16 there.
    pub(crate) fn for_format(self, kind: WeightFormat) -> Isa {
        match (self, kind) {
            _ if !self.available() => Isa::Scalar,
            (Isa::Avx512Bw, WeightFormat::Q8 { .. }) => Isa::Avx2,
            _ => self,
        }
    }
}

/// Precision of the activations inside the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    F32,
    /// int8 per 32-value block (INT4 / MXFP4 / Q8 weights only; others run in f32).
    I8,
    /// 16 bits per 32-value block as two int8 planes (INT4 / MXFP4 / Q8 only).
    I16,
    /// Rounded to BF16 and multiplied by AVX-512 BF16 `vdpbf16ps` (BF16 weights only, opt-in:
    /// llama.cpp's BF16 precision, not the fixtures').
    Bf16,
    /// Split into two BF16 values (`hi + lo`, about 2^-17 relative; the tiles read denormal
    /// values as zero and flush denormal results, as `DAZ`/`FTZ` would) and multiplied by AMX tiles
    /// (BF16 weights on CPUs with AMX-BF16; `kernels/x86_amx.rs`). Within the fixtures'
    /// tolerance; opt-in (`DELTAFIN_AMX=on`): faster prefill, slower decode.
    Bf16x2,
}

/// Which kernels a model's matrices run: the instruction set, and whether the integer formats
/// may use quantized activations. Chosen when a model is loaded and carried by every matrix, so
/// one process can run two models on two paths (tests compare them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelConfig {
    pub isa: Isa,
    /// Keep f32 activations for INT4 / MXFP4 / Q8 too.
    pub f32_activations: bool,
    /// Round activations to BF16 for BF16 weights where the CPU has AVX-512 BF16
    /// ([`Act::Bf16`]); elsewhere f32 as usual.
    pub bf16_activations: bool,
    /// 8-bit activations ([`Act::I8`]) for INT4 / MXFP4 / Q8 where the SIMD kernels run.
    pub i8_activations: bool,
    /// BF16 weights on the AMX tiles ([`Act::Bf16x2`], opt-in) where the CPU has AMX-BF16 and
    /// the AVX-512 kernels run.
    pub amx: bool,
}

/// The words `DELTAFIN_ACTIVATIONS` takes, in a comma list.
const ACTIVATION_WORDS: [&str; 3] = ["f32", "bf16", "i8"];

/// The non-empty words of a `DELTAFIN_ACTIVATIONS` value.
fn activation_words(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|w| !w.is_empty())
}

impl Default for KernelConfig {
    /// [`KernelConfig::from_env`].
    fn default() -> Self {
        KernelConfig::from_env()
    }
}

impl KernelConfig {
    /// The best kernels this machine runs.
    pub fn best() -> KernelConfig {
        KernelConfig {
            isa: Isa::best(),
            f32_activations: false,
            bf16_activations: false,
            i8_activations: false,
            amx: false,
        }
    }

    /// Kernels on `isa` (capped to what this machine runs).
    pub fn with_isa(isa: Isa) -> KernelConfig {
        KernelConfig {
            isa: Isa::capped(isa),
            f32_activations: false,
            bf16_activations: false,
            i8_activations: false,
            amx: false,
        }
    }

    /// The default: the best kernels, capped by `DELTAFIN_KERNELS=scalar|avx2|avxvnni`, with
    /// `DELTAFIN_ACTIVATIONS=f32` forcing f32 activations, `DELTAFIN_ACTIVATIONS=bf16` asking
    /// for [`Act::Bf16`] and `DELTAFIN_ACTIVATIONS=i8` for [`Act::I8`] (a comma list takes
    /// both: `i8,bf16` is llama.cpp's own precision on a model with BF16 and quantized
    /// matrices), and `DELTAFIN_AMX=on` for [`Act::Bf16x2`] (read once per process).
    pub fn from_env() -> KernelConfig {
        static FROM_ENV: OnceLock<KernelConfig> = OnceLock::new();
        *FROM_ENV.get_or_init(|| {
            let cap = std::env::var("DELTAFIN_KERNELS").unwrap_or_default();
            let isa = match Isa::parse(&cap) {
                Some(i) => Isa::capped(i),
                None => Isa::best(),
            };
            let acts = std::env::var("DELTAFIN_ACTIVATIONS").unwrap_or_default();
            let asks = |name: &str| activation_words(&acts).any(|a| a.eq_ignore_ascii_case(name));
            KernelConfig {
                isa,
                f32_activations: asks("f32"),
                bf16_activations: asks("bf16"),
                i8_activations: asks("i8"),
                amx: {
                    let v = std::env::var("DELTAFIN_AMX").unwrap_or_default();
                    v.eq_ignore_ascii_case("on") || v == "1"
                },
            }
        })
    }

    /// What is wrong with the kernel settings in the environment (`DELTAFIN_KERNELS`,
    /// `DELTAFIN_ACTIVATIONS`): each word neither knows, so that a front end can refuse to run
    /// with a setting [`KernelConfig::from_env`] would silently ignore (a typo in an A/B).
    pub fn env_errors() -> Vec<String> {
        let var = |k: &str| std::env::var(k).unwrap_or_default();
        Self::setting_errors(&var("DELTAFIN_KERNELS"), &var("DELTAFIN_ACTIVATIONS"))
    }

    /// [`KernelConfig::env_errors`] of the two values given.
    fn setting_errors(kernels: &str, activations: &str) -> Vec<String> {
        let mut errors = Vec::new();
        if !kernels.is_empty() && Isa::parse(kernels).is_none() {
            let names: Vec<&str> = Isa::NAMES.iter().map(|&(n, _)| n).collect();
            errors.push(format!(
                "DELTAFIN_KERNELS={kernels:?}: not one of {}",
                names.join(", ")
            ));
        }
        for word in activation_words(activations) {
            if !ACTIVATION_WORDS
                .iter()
                .any(|k| word.eq_ignore_ascii_case(k))
            {
                errors.push(format!(
                    "DELTAFIN_ACTIVATIONS={activations:?}: {word:?} is not one of {} (a comma \
                     list)",
                    ACTIVATION_WORDS.join(", ")
                ));
            }
        }
        errors
    }

    /// The instruction set's name, with `+AMX` where BF16 weights run on the AMX tiles
    /// ([`Act::Bf16x2`]): what benchmark records say the kernels were.
    pub fn label(&self) -> String {
        if self.act(WeightFormat::Bf16) == Act::Bf16x2 {
            format!("{:?}+AMX", self.isa)
        } else {
            format!("{:?}", self.isa)
        }
    }

    /// The activation precision `format` runs with: [`Act::I16`] for the integer formats on
    /// x86_64 with AVX2, AVX-VNNI or AVX-512 VNNI (within the fixtures' tolerance; AVX-512: at
    /// memory speed; AVX2: INT4 / MXFP4 twice the f32 kernels' speed, Q8 1.0-1.4x), f32
    /// elsewhere (NEON has no 16-bit kernels yet) or when f32 activations are asked for;
    /// [`Act::Bf16`] for BF16 weights when asked for and the CPU has AVX-512 BF16 (without it,
    /// f32: the exact path, never an emulation); otherwise [`Act::Bf16x2`] for BF16 weights
    /// when AMX is asked for and the AVX-512 kernels run on a CPU with AMX-BF16.
    pub fn act(&self, format: WeightFormat) -> Act {
        #[cfg(target_arch = "x86_64")]
        if self.amx
            && !self.bf16_activations
            && !self.f32_activations
            && format == WeightFormat::Bf16
            && self.isa.has_avx512()
            && super::x86_amx::available()
        {
            return Act::Bf16x2;
        }
        #[cfg(target_arch = "x86_64")]
        if self.bf16_activations
            && format == WeightFormat::Bf16
            && self.isa.has_avx512()
            && super::x86_avx512_bf16::available()
        {
            return Act::Bf16;
        }
        if self.i8_activations && format.integer() && self.isa != Isa::Scalar {
            return Act::I8;
        }
        if !self.f32_activations
            && format.integer()
            && matches!(
                self.isa,
                Isa::Avx512 | Isa::Avx512Bw | Isa::AvxVnni | Isa::Avx2
            )
        {
            Act::I16
        } else {
            Act::F32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_with_unknown_words_are_named() {
        assert!(KernelConfig::setting_errors("", "").is_empty());
        assert!(KernelConfig::setting_errors("avx2", "i8,BF16").is_empty());
        assert!(KernelConfig::setting_errors("scalar", " f32 ").is_empty());
        let e = KernelConfig::setting_errors("avx-512", "i8,bf61");
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[0].contains("DELTAFIN_KERNELS=\"avx-512\""), "{e:?}");
        assert!(e[1].contains("\"bf61\""), "{e:?}");
    }

    #[test]
    fn caps_never_exceed_what_runs() {
        assert_eq!(Isa::capped(Isa::Scalar), Isa::Scalar);
        for cap in [
            Isa::Avx2,
            Isa::AvxVnni,
            Isa::Avx512Bw,
            Isa::Avx512,
            Isa::Neon,
        ] {
            let got = Isa::capped(cap);
            assert!(got.available());
        }
        let k = KernelConfig::with_isa(Isa::Scalar);
        assert_eq!(k.act(WeightFormat::Int4 { group: 32 }), Act::F32);
        assert_eq!(KernelConfig::best().act(WeightFormat::Bf16), Act::F32);
    }
}
