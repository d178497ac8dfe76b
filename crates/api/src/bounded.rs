//! The proto's length limits on messages, and the one way every message is cut to them.

/// Longest `Step.message` the proto allows, in bytes.
pub const MAX_STEP_MESSAGE: usize = 256;
/// Longest change, check or error message the proto allows, in bytes.
pub const MAX_DETAIL: usize = 1024;
/// Longest hook response message the proto allows, in bytes.
pub const MAX_HOOK_MESSAGE: usize = 512;

/// `s` cut to at most `max` bytes at character boundaries: when it is too long, its start
/// (a third: what failed) and its end (the rest: the last lines a command printed, where
/// dpkg, dnf and kubeadm say why) joined by ` ... `.
pub fn bounded(s: &str, max: usize) -> String {
    const GAP: &str = " ... ";
    if s.len() <= max {
        return s.to_owned();
    }
    if max < 2 * GAP.len() {
        // Too short to show both ends: only the start.
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        return s[..end].to_owned();
    }
    let room = max - GAP.len();
    let mut head = room / 3;
    while !s.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = s.len() - (room - head);
    while !s.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{}{GAP}{}", &s[..head], &s[tail..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_at_char_boundaries_keeping_both_ends() {
        assert_eq!(bounded("short", 10), "short");
        assert_eq!(bounded("longer than four", 4), "long");
        let long = "é".repeat(300);
        let cut = bounded(&long, MAX_STEP_MESSAGE);
        assert!(cut.len() <= MAX_STEP_MESSAGE && cut.len() >= MAX_STEP_MESSAGE - 2);
        assert!(cut.starts_with("éé") && cut.contains(" ... ") && cut.ends_with("éé"));
        // A failed command's message keeps what it said last.
        let detail = format!(
            "install x: exit status 100\noutput:\n{}\nE: the reason",
            "progress\n".repeat(500)
        );
        let cut = bounded(&detail, MAX_DETAIL);
        assert!(cut.len() <= MAX_DETAIL);
        assert!(cut.starts_with("install x: exit status 100") && cut.ends_with("E: the reason"));
    }
}
