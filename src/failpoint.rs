//! Process-abort injection for crash tests (feature `failpoints`).
