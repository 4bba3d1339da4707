//! `deltafin generate`: [`args`] (the flags), [`loaded`] (the model, tokenizer and budget),
//! [`tokenizer`], [`run`] (stream the tokens), [`report`] (the summary and JSON).

pub mod args;
pub mod loaded;
pub mod report;
pub mod run;
pub mod tokenizer;
