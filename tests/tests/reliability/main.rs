//! Reliability: crashes at every step boundary, database faults, frozen workers and real worker processes killed mid-job.
//!
//! One test binary for the group; each module is a suite.
#![allow(clippy::unwrap_used)]

mod crash_matrix;
mod db_faults;
mod lease_pause;
mod send_crash;
mod worker_process;
