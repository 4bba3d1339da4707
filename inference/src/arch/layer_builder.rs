//! [`LayerBuilder`]: how a family builds one decoder layer, and [`LayerFactory`], what a model
//! keeps to rebuild its streamed layers over the weights read for each forward.

use std::fmt;

use deltafin_storage::naming::ExpertNaming;

use crate::error::Result;
use crate::kernels::isa::KernelConfig;
use crate::linear::resolve::QuantHints;
use crate::loader::Loader;
use crate::model::DecoderLayer;
use crate::weights::WeightSource;

/// Builds one decoder layer of a family from a loader.
pub(crate) trait LayerBuilder: Send + Sync + fmt::Debug {
    fn layer(&self, ld: &Loader<'_>, l: usize) -> Result<DecoderLayer>;
}

/// How a model rebuilds a streamed layer over the weights read for one forward.
#[derive(Debug)]
pub struct LayerFactory {
    builder: Box<dyn LayerBuilder>,
    hints: QuantHints,
    kernels: KernelConfig,
    naming: ExpertNaming,
    prefix: &'static str,
}

impl LayerFactory {
    pub(crate) fn new(
        builder: Box<dyn LayerBuilder>,
        hints: QuantHints,
        kernels: KernelConfig,
        naming: ExpertNaming,
        prefix: &'static str,
    ) -> LayerFactory {
        LayerFactory {
            builder,
            hints,
            kernels,
            naming,
            prefix,
        }
    }

    /// Decoder layer `l` from a loader the caller made (the model's resident weights).
    pub(crate) fn build_with(&self, ld: &Loader<'_>, l: usize) -> Result<DecoderLayer> {
        self.builder.layer(ld, l)
    }

    /// Decoder layer `l` from `src` (a streamed layer's weights).
    pub fn build(&self, src: &dyn WeightSource, l: usize) -> Result<DecoderLayer> {
        let ld = Loader {
            src,
            hints: self.hints,
            kernels: self.kernels,
            naming: self.naming.clone(),
            prefix: self.prefix,
        };
        self.builder.layer(&ld, l)
    }
}
