//! Validation errors: every error names the field path, and a plan reports all of them.

use std::fmt;

/// One problem with one field: `changes[3].file.mode: "0999" is not an octal mode`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct FieldError {
    /// Field path in plan-file terms (`changes[3].file.mode`); empty for the document.
    pub field: String,
    /// What is wrong, lowercase, no trailing period.
    pub message: String,
    /// Why, when it was not the plan but the node that could not be read or written (a
    /// refused permission, an I/O error): the kind of the error underneath. Not part of the
    /// wire shape; a caller decides by it whether the plan or the environment is at fault.
    #[serde(skip)]
    pub cause: Option<inplace_base::ErrorKind>,
}

impl FieldError {
    /// A new error at `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> FieldError {
        FieldError {
            field: field.into(),
            message: message.into(),
            cause: None,
        }
    }

    /// An error at `field` whose cause has the kind `cause`.
    pub fn caused(
        field: impl Into<String>,
        message: impl Into<String>,
        cause: inplace_base::ErrorKind,
    ) -> FieldError {
        FieldError {
            cause: Some(cause),
            ..FieldError::new(field, message)
        }
    }

    /// The node, not the plan, is at fault: it could not be read or written (the kind
    /// underneath is `io` or `disk_full`).
    pub fn of_environment(&self) -> bool {
        use inplace_base::ErrorKind;
        matches!(self.cause, Some(ErrorKind::Io | ErrorKind::DiskFull))
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
