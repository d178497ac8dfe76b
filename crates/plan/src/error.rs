//! Validation errors: every error names the field path, and a plan reports all of them.

use std::fmt;

/// One problem with one field: `changes[3].file.mode: "0999" is not an octal mode`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FieldError {
    /// Field path in plan-file terms (`changes[3].file.mode`); empty for the document.
    pub field: String,
    /// What is wrong, lowercase, no trailing period.
    pub message: String,
}

impl FieldError {
    /// A new error at `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> FieldError {
        FieldError {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

/// A plan that failed validation, with every error found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InvalidPlan {
    /// Where the plan came from (a file name, `request`).
    pub source: String,
    /// All errors, in document order.
    pub errors: Vec<FieldError>,
}

impl fmt::Display for InvalidPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.errors.len();
        write!(
            f,
            "invalid plan {}: {} error{}",
            self.source,
            n,
            if n == 1 { "" } else { "s" }
        )?;
        for e in &self.errors {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for InvalidPlan {}
