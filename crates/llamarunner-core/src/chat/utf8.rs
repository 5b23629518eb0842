//! UTF-8 from token bytes, which may end inside a character.

/// Appends the complete UTF-8 characters at the start of `bytes` to `out`, each invalid
/// sequence as one U+FFFD; returns how many bytes it used (an incomplete character at the end
/// is left for more bytes to complete).
pub fn decode_utf8(bytes: &[u8], out: &mut String) -> usize {
    let mut rest = bytes;
    let mut used = 0;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                return used + rest.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                match e.error_len() {
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        used += valid + bad;
                        rest = &rest[valid + bad..];
                    }
                    None => return used + valid,
                }
            }
        }
    }
}
