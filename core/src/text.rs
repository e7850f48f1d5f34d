//! Text a human reads and trusts: Unicode format characters (category Cf: bidirectional
//! overrides and isolates, zero-width characters, invisible operators, tag characters) are
//! invisible or reorder what is shown, so a reviewer could approve a subject or a name that
//! reads otherwise than it is. Fields shown to reviewers refuse them.

/// The first format character of `s`: its position (in characters) and itself.
pub fn find_format_char(s: &str) -> Option<(usize, char)> {
    s.chars().enumerate().find(|&(_, c)| is_format(c))
}

/// A clear refusal naming the first format character of `s`, if it has one.
pub fn refuse_format_chars(s: &str) -> Result<(), String> {
    match find_format_char(s) {
        None => Ok(()),
        Some((at, c)) => Err(format!(
            "must not contain invisible or direction-changing Unicode format characters (U+{:04X} at character {at})",
            c as u32
        )),
    }
}

/// The longest note or reason a human may give, in characters.
pub const MAX_NOTE_CHARS: usize = 2000;

/// A human's note or reason, the one rule for every human action (each is recorded with
/// why): 1 to [`MAX_NOTE_CHARS`] characters once trimmed, with no format characters (the
/// note is shown to the next reviewer and in the audit log). The error names `field`.
pub fn human_note<'a>(note: Option<&'a str>, field: &str) -> Result<&'a str, String> {
    match note.map(str::trim) {
        Some(n) if !n.is_empty() && n.chars().count() <= MAX_NOTE_CHARS => {
            refuse_format_chars(n).map_err(|e| format!("{field}: {e}"))?;
            Ok(n)
        }
        _ => Err(format!(
            "{field}: 1 to {MAX_NOTE_CHARS} characters are required (every human action is recorded with why)"
        )),
    }
}

/// Unicode's general category Cf (format), as of Unicode 16.
pub fn is_format(c: char) -> bool {
    matches!(
        c as u32,
        0x00AD
            | 0x0600..=0x0605
            | 0x061C
            | 0x06DD
            | 0x070F
            | 0x0890..=0x0891
            | 0x08E2
            | 0x180E
            | 0x200B..=0x200F
            | 0x202A..=0x202E
            | 0x2060..=0x2064
            | 0x2066..=0x206F
            | 0xFEFF
            | 0xFFF9..=0xFFFB
            | 0x110BD
            | 0x110CD
            | 0x13430..=0x1343F
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0001
            | 0xE0020..=0xE007F
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_is_required_trimmed_bounded_and_visible() {
        assert_eq!(human_note(Some("  checked  "), "note"), Ok("checked"));
        for bad in [None, Some(""), Some("   "), Some("ok\u{202E}")] {
            assert!(human_note(bad, "note").unwrap_err().starts_with("note: "), "{bad:?}");
        }
        assert!(human_note(Some(&"é".repeat(2000)), "note").is_ok());
        assert!(human_note(Some(&"é".repeat(2001)), "reason").unwrap_err().starts_with("reason: "));
    }

    #[test]
    fn format_characters_are_found_where_they_are() {
        for c in [
            '\u{202E}',
            '\u{202A}',
            '\u{2066}',
            '\u{2069}',
            '\u{200B}',
            '\u{200D}',
            '\u{FEFF}',
            '\u{00AD}',
            '\u{E0041}',
        ] {
            let s = format!("ab{c}c");
            assert_eq!(find_format_char(&s), Some((2, c)), "U+{:04X}", c as u32);
            assert!(refuse_format_chars(&s).unwrap_err().contains(&format!("U+{:04X}", c as u32)));
        }
        for fine in ["Invoice 42", "Ünïcödé ✓ 日本語", "emoji 🙂", "a\tb", "", "עברית"] {
            assert_eq!(find_format_char(fine), None, "{fine}");
        }
    }
}
