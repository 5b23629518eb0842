//! Text cut to fit what carries it: an error message, a log line, a file's description.

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
pub fn truncated(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::truncated;

    #[test]
    fn text_is_cut_on_a_character_boundary() {
        assert_eq!(truncated("héllo", 2), "h");
        assert_eq!(truncated("héllo", 3), "hé");
        assert_eq!(truncated("héllo", 100), "héllo");
        assert_eq!(truncated("", 0), "");
    }
}
