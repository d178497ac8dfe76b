//! The engine: runs one plan at a time through its phases, journaling every step.

pub mod status;
