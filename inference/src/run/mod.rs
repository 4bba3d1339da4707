//! Running a model as a command does: open it from a path ([`open`]), split a RAM budget
//! ([`residency`]: what to hold and what to stream, [`budget`], [`memory`]), and measure a generation ([`measure`]).

pub mod budget;
pub mod calibrate;
pub mod hit_rate;
pub mod measure;
pub mod memory;
pub mod model_bytes;
pub mod open;
pub mod plan;
pub mod residency;

pub use budget::{plan_budget, Budget};
pub use measure::{measure_generation, GenStep, Measured};
pub use open::{open_model, ModelPath, OpenOptions, OpenedModel, StreamChoice};
pub use residency::{choose_residency, RamRequest, Residency};
