//! What the bench shares with the suites: the history it measures on top of, and the plans
//! of the statements the schema's functions run.

pub mod history;
pub mod plans;
