//! How the updater says what went wrong.

/// An error and its causes, each said once (errors here often repeat their source's text);
/// the one rendering both binaries use ([`inplace_base::chain`]).
pub fn chain(e: &anyhow::Error) -> String {
    inplace_base::chain(e.as_ref())
}
