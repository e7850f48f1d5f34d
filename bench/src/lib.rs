//! What the bench shares with the suites: the history it measures on top of.

pub mod history;
