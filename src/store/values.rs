//! Values a store can hold: JSON without U+0000, nested at most [`MAX_JSON_DEPTH`] levels and
//! of a bounded size ([`check_storable`]), and text cut to print ([`printable`]).

use crate::task::TaskError;

/// The deepest nesting of arrays and objects a stored JSON value may have. Readers decode
/// stored values with serde_json, which stops at 128 levels: a deeper value could be written
/// and never read back (and every claim that met it would fail).
pub const MAX_JSON_DEPTH: usize = 100;

/// Why a JSON value cannot be stored, or could not be read back once stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnstorableValue {
    /// Text (a string or an object key) holds U+0000, which PostgreSQL's `jsonb` refuses.
    #[error("{path} contains U+0000, which PostgreSQL cannot store: expected text without NUL characters")]
    Nul {
        /// Where, as `$` followed by keys and indexes (`$.a[2]`).
        path: String,
    },
    /// Nested deeper than [`MAX_JSON_DEPTH`].
    #[error("{path} is nested more than {MAX_JSON_DEPTH} levels deep: expected at most {MAX_JSON_DEPTH}")]
    TooDeep {
        /// Where the limit was passed.
        path: String,
    },
    /// Larger than the limit.
    #[error("it takes more than {max} bytes as JSON: expected at most {max}")]
    TooLarge {
        /// The limit, in bytes.
        max: u64,
    },
}

/// Checks that `value` can be stored as `jsonb` and read back: no U+0000 in any string or
/// key, at most [`MAX_JSON_DEPTH`] levels, at most `max_bytes` bytes as JSON. Returns its size
/// as JSON, estimated: exact for integers, strings and structure (escapes aside), 24 bytes for
/// a float. Walks the value without recursion.
pub fn check_storable(value: &serde_json::Value, max_bytes: u64) -> Result<u64, UnstorableValue> {
    use serde_json::Value;
    enum Step<'a> {
        Key(&'a str),
        Index(usize),
    }
    fn path_of(steps: &[Step<'_>]) -> String {
        let mut path = String::from("$");
        for step in steps {
            match step {
                Step::Key(key) => {
                    path.push('.');
                    // Escaped: the key itself may be what is wrong.
                    path.push_str(&printable(key, 64));
                }
                Step::Index(index) => path.push_str(&format!("[{index}]")),
            }
        }
        path
    }
    // Each entry: a value, its depth (1 for the root) and the step that led to it.
    let mut stack: Vec<(&Value, usize, Option<Step<'_>>)> = vec![(value, 1, None)];
    let mut steps: Vec<Step<'_>> = Vec::new();
    let mut bytes: u64 = 0;
    while let Some((value, depth, step)) = stack.pop() {
        steps.truncate(depth.saturating_sub(2));
        if let Some(step) = step {
            steps.push(step);
        }
        let nul = |text: &str| text.contains('\0');
        // Each value: its own bytes and a separator.
        bytes = bytes.saturating_add(1).saturating_add(match value {
            Value::Null | Value::Bool(_) => 5,
            Value::Number(number) => match (number.as_u64(), number.as_i64()) {
                (Some(n), _) => digits(n),
                (None, Some(n)) => digits(n.unsigned_abs()) + 1,
                _ => 24,
            },
            Value::String(text) => {
                if nul(text) {
                    return Err(UnstorableValue::Nul { path: path_of(&steps) });
                }
                text.len() as u64 + 3
            }
            Value::Array(items) => {
                if depth > MAX_JSON_DEPTH {
                    return Err(UnstorableValue::TooDeep { path: path_of(&steps) });
                }
                stack.extend(items.iter().enumerate().rev().map(|(i, item)| (item, depth + 1, Some(Step::Index(i)))));
                2
            }
            Value::Object(fields) => {
                if depth > MAX_JSON_DEPTH {
                    return Err(UnstorableValue::TooDeep { path: path_of(&steps) });
                }
                let mut size = 2u64;
                for (key, _) in fields {
                    if nul(key) {
                        steps.push(Step::Key(key));
                        return Err(UnstorableValue::Nul { path: path_of(&steps) });
                    }
                    size = size.saturating_add(key.len() as u64 + 3);
                }
                let children: Vec<_> =
                    fields.iter().map(|(k, v)| (v, depth + 1, Some(Step::Key(k.as_str())))).collect();
                stack.extend(children.into_iter().rev());
                size
            }
        });
        if bytes > max_bytes {
            return Err(UnstorableValue::TooLarge { max: max_bytes });
        }
    }
    Ok(bytes)
}

/// How many decimal digits `n` has.
fn digits(n: u64) -> u64 {
    n.checked_ilog10().map_or(1, |log| u64::from(log) + 1)
}

/// Checks a handler's error as [`check_storable`] checks values: its code and message are
/// text inside the stored JSON, so U+0000 there is refused too; its data counts against
/// `max_bytes`. Returns its estimated size as JSON.
pub fn check_storable_error(error: &TaskError, max_bytes: u64) -> Result<u64, UnstorableValue> {
    if error.message.contains('\0') {
        return Err(UnstorableValue::Nul { path: "$.message".into() });
    }
    if error.code.as_str().contains('\0') {
        return Err(UnstorableValue::Nul { path: "$.code".into() });
    }
    let text = (error.message.len() + error.code.as_str().len()) as u64 + 40;
    match &error.data {
        Some(data) => {
            check_storable(data, max_bytes.saturating_sub(text)).map(|size| size + text).map_err(
                |problem| match problem {
                    UnstorableValue::Nul { path } => UnstorableValue::Nul { path: path.replacen('$', "$.data", 1) },
                    UnstorableValue::TooDeep { path } => {
                        UnstorableValue::TooDeep { path: path.replacen('$', "$.data", 1) }
                    }
                    UnstorableValue::TooLarge { .. } => UnstorableValue::TooLarge { max: max_bytes },
                },
            )
        }
        None if text > max_bytes => Err(UnstorableValue::TooLarge { max: max_bytes }),
        None => Ok(text),
    }
}

/// `text` with control characters (U+0000 among them) escaped and cut to about `max` bytes,
/// for messages that quote what a handler or the database said.
pub fn printable(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max) + 3);
    for c in text.chars() {
        if out.len() >= max {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::json;

    use super::*;
    use crate::task::ErrorCode;

    /// A JSON array nested `depth` levels deep.
    pub(crate) fn nested(depth: usize) -> serde_json::Value {
        (1..depth).fold(json!([]), |inner, _| json!([inner]))
    }

    #[test]
    fn storable_values_have_no_nul_no_deep_nesting_and_a_bounded_size() {
        assert!(check_storable(&json!({"a": [1, "ok", {"b": null}]}), 1_000).is_ok());
        let nul = |v: serde_json::Value| check_storable(&v, 1_000).unwrap_err().to_string();
        assert!(
            nul(json!({"a": [1, "no\u{0}"]})).starts_with("$.a[1] contains U+0000"),
            "{}",
            nul(json!({"a": [1, "no\u{0}"]}))
        );
        assert!(nul(json!({"k\u{0}": 1})).starts_with("$.k\\u{0} contains U+0000"));
        assert!(nul(json!([{"x": 1}, {"y": ["\u{0}"]}])).starts_with("$[1].y[0] contains"));
        assert!(check_storable(&nested(MAX_JSON_DEPTH), u64::MAX).is_ok());
        assert!(matches!(check_storable(&nested(MAX_JSON_DEPTH + 1), u64::MAX), Err(UnstorableValue::TooDeep { .. })));
        assert_eq!(check_storable(&json!("x".repeat(100)), 50), Err(UnstorableValue::TooLarge { max: 50 }));
        assert!(check_storable(&json!("x".repeat(10)), 50).is_ok());
        // Integers count by their digits: 400,000 one-digit items are about 800 kB as JSON.
        let digits = serde_json::Value::Array((0..400_000).map(|i| json!(i % 10)).collect());
        let size = check_storable(&digits, 8 * 1024 * 1024).expect("well under 8 MiB");
        assert!((800_000..=900_000).contains(&size), "{size}");
        assert_eq!(
            check_storable(&json!([-12345, 18_446_744_073_709_551_615u64, 1.5]), 1_000).map(|s| s > 30),
            Ok(true)
        );
    }

    #[test]
    fn a_stored_error_is_checked_in_its_message_code_and_data() {
        let error = TaskError::new(ErrorCode::TaskError, "fine");
        assert!(check_storable_error(&error, 100).is_ok());
        let nul = TaskError::new(ErrorCode::TaskError, "from C: \u{0}");
        assert_eq!(check_storable_error(&nul, 100), Err(UnstorableValue::Nul { path: "$.message".into() }));
        let data = error.clone().with_data(json!({"d": "\u{0}"}));
        assert_eq!(check_storable_error(&data, 100), Err(UnstorableValue::Nul { path: "$.data.d".into() }));
        let big = error.with_data(json!("y".repeat(200)));
        assert_eq!(check_storable_error(&big, 100), Err(UnstorableValue::TooLarge { max: 100 }));
    }

    #[test]
    fn printable_text_escapes_control_characters_and_is_cut() {
        assert_eq!(printable("a\u{0}b\nc", 100), "a\\u{0}b\\nc");
        assert_eq!(printable(&"z".repeat(20), 5), "zzzzz…");
    }
}
