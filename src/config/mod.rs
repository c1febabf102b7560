//! Configuration: the TOML schema ([`schema`], serde types only), files that extend a base
//! ([`extends`]; their paths, [`paths`]), layering with figment ([`resolve`]), and the reference of every key generated from
//! the schema ([`reference`]). `crate::plan` turns a resolved configuration into the validated plan.
pub mod extends;
pub mod paths;
pub mod reference;
pub mod resolve;
pub mod schema;

pub use resolve::{resolve, Override, Resolved};
pub use schema::Config;

/// A configuration the user must fix: the message says what, where and how. Exit code 2.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ConfigError {
    pub message: String,
}

impl ConfigError {
    pub fn new(message: impl Into<String>) -> Self {
        ConfigError { message: message.into() }
    }
}
