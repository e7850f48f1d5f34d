//! The delivery pipeline: persist → score → review → approve → send → receipt.

pub mod state;
