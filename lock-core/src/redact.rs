//! Redaction of credentials in connection strings, for backend implementors.
//!
//! Every parser that echoes a URL, an endpoint or a connection string in an
//! error, a `Debug` form or a log line passes it through [`redact_url`]
//! first, so that one rule decides what counts as a secret.

/// The text that replaces a credential.
const MASK: &str = "***";

/// Parameter names whose values are secrets, compared without case.
const SECRET_KEYS: &[&str] = &["password", "pass", "secret", "token", "sslpassword"];

/// Returns `url` with every credential replaced by `***`, for error messages,
/// `Debug` forms and logs.
///
/// It accepts any text, well-formed or not, and masks:
///
/// - **user information**: everything from just after `scheme://` (or from
///   the start, when there is no scheme, as in `user:pw@host:2379`) up to the
///   *last* `@`, except a user name written before a `:`. Taking the last
///   `@` means a password with an unencoded `/ ? # @ :` or `%` is masked
///   whole, even where a URL parser would have split it; an `@` later in a
///   path or query only widens the mask, it never narrows it.
/// - **secret parameters**: the values of `password`, `pass`, `secret`,
///   `token` and `sslpassword` (any case), both as URL query parameters
///   (`?password=…`) and in libpq `key=value` strings
///   (`host=db password='…'`). A quoted value is masked up to its closing
///   quote; an unquoted one up to the end of the text, since it may hold an
///   unencoded `&`, space or `=` that no parser could tell from the next
///   parameter.
///
/// A `key=value` string (no `scheme://`, first word `key=`) has no user
/// information; only its secret parameters are masked.
///
/// # Examples
///
/// ```
/// use lock_core::redact::redact_url;
///
/// assert_eq!(redact_url("redis://app:s3cret@db:6379/0"), "redis://app:***@db:6379/0");
/// assert_eq!(redact_url("redis://u:ab/s3cret@h:x"), "redis://u:***@h:x");
/// assert_eq!(redact_url("http://root:p@ss@h:2379"), "http://root:***@h:2379");
/// assert_eq!(
///     redact_url("postgres://db/app?sslmode=require&password=s3cret"),
///     "postgres://db/app?sslmode=require&password=***"
/// );
/// assert_eq!(redact_url("postgres://app@db/app"), "postgres://***@db/app");
/// assert_eq!(
///     redact_url("host=db password='a b' user=app"),
///     "host=db password=*** user=app"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    let mut masked = vec![false; url.len()];
    let authority = authority_start(url);
    let key_value = authority.is_none() && looks_like_key_value(url);
    if !key_value {
        mask_user_info(url, authority.unwrap_or(0), &mut masked);
    }
    mask_secret_parameters(url, &mut masked);
    render(url, &masked)
}

/// Where the authority starts: just after a well-formed `scheme://`.
fn authority_start(url: &str) -> Option<usize> {
    let (scheme, _) = url.split_once("://")?;
    let mut chars = scheme.chars();
    let well_formed = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    well_formed.then_some(scheme.len() + 3)
}

/// Whether `text` is a libpq `key=value` string: its first word is `key=`.
fn looks_like_key_value(text: &str) -> bool {
    let first = text.trim_start();
    let key_len = first
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(first.len());
    key_len > 0 && first[key_len..].trim_start().starts_with('=')
}

/// Masks `[start, last '@')`, keeping a user name that precedes a `:`
/// unless it holds a character no user name in a well-formed URL has (then
/// the split is a guess, and the whole is masked).
fn mask_user_info(url: &str, start: usize, masked: &mut [bool]) {
    let Some(at) = url[start..].rfind('@').map(|i| start + i) else {
        return;
    };
    let from = match url[start..at].split_once(':') {
        Some((user, _)) if !user.contains(['/', '?', '#', '@']) => start + user.len() + 1,
        _ => start,
    };
    for m in &mut masked[from..at] {
        *m = true;
    }
}

/// Masks the values of secret parameters, in `?a=b&c=d` and `a=b c='d'` form.
fn mask_secret_parameters(url: &str, masked: &mut [bool]) {
    let bytes = url.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let at_boundary =
            i == 0 || matches!(bytes[i - 1], b'?' | b'&' | b'#' | b';' | b' ' | b'\t');
        let key_len = bytes[i..]
            .iter()
            .take_while(|b| b.is_ascii_alphanumeric() || **b == b'_')
            .count();
        if !at_boundary || key_len == 0 {
            i += 1;
            continue;
        }
        let key = &url[i..i + key_len];
        let mut j = i + key_len;
        while j < bytes.len() && bytes[j] == b' ' {
            j += 1;
        }
        if j >= bytes.len() || bytes[j] != b'=' {
            i += key_len;
            continue;
        }
        j += 1;
        while j < bytes.len() && bytes[j] == b' ' {
            j += 1;
        }
        if !SECRET_KEYS.iter().any(|k| k.eq_ignore_ascii_case(key)) {
            i = j;
            continue;
        }
        let end = secret_value_end(bytes, j);
        for m in &mut masked[j..end] {
            *m = true;
        }
        i = end;
    }
}

/// Where a secret value starting at `start` ends: after its closing quote
/// when quoted (backslash escapes, as libpq), otherwise at the end of the
/// text. An unquoted value may hold an unencoded `&`, space or `key=` of its
/// own, so no later separator can be trusted to end it.
fn secret_value_end(bytes: &[u8], start: usize) -> usize {
    if bytes.get(start) != Some(&b'\'') {
        return bytes.len();
    }
    let mut k = start + 1;
    while k < bytes.len() {
        match bytes[k] {
            b'\\' => k += 2,
            b'\'' => return k + 1,
            _ => k += 1,
        }
    }
    bytes.len()
}

/// Replaces each run of masked bytes with one [`MASK`].
fn render(url: &str, masked: &[bool]) -> String {
    let mut out = String::with_capacity(url.len());
    let mut in_mask = false;
    for (i, c) in url.char_indices() {
        if masked[i] {
            if !in_mask {
                out.push_str(MASK);
                in_mask = true;
            }
        } else {
            out.push(c);
            in_mask = false;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    /// Every password below is built from tokens holding this marker.
    const MARKER: &str = "zqk";

    const PASSWORDS: &[&str] = &[
        "zqka",
        "zqka/zqkb+zqkc==",
        "zqka?zqkb",
        "zqka#zqkb",
        "zqka@zqkb",
        "zqka:zqkb",
        "zqka/zqkb?zqkc#zqkd@zqke:zqkf",
        "zqka%2Fzqkb%40zqkc%3Azqkd",
        "zqka%zqkb",
        "zqka&zqkb=zqkc",
        "zqka zqkb",
        "zqka;zqkb",
        "zqkä€zqkb",
    ];

    const TEMPLATES: &[&str] = &[
        "redis://u:{pw}@h:6379/0",
        "rediss://:{pw}@h:x",
        "postgres://u:{pw}@h1:5432,h2:5432/db?sslmode=require",
        "postgresql://u:{pw}@h/db?application_name=a@b",
        "etcd://u:{pw}@a:1,b:2",
        "http://u:{pw}@h:2379",
        "u:{pw}@h:2379",
        "{pw}@h:2379",
        "redis://h:1/0?password={pw}",
        "redis://h:1/0?protocol=3&PASS={pw}",
        "postgres://h/db?sslpassword={pw}&sslmode=require",
        "http://h:2379?token={pw}",
        "http://h:2379/?x=1&secret={pw}#frag",
        "host=h password={pw} port=5432",
        "host=h password = '{pw}' port=5432",
        "password={pw}",
        "  user=u  password='{pw}",
    ];

    fn quoted(pw: &str) -> String {
        pw.replace('\\', "\\\\").replace('\'', "\\'")
    }

    #[test]
    fn no_password_survives_in_any_position() {
        for pw in PASSWORDS {
            for template in TEMPLATES {
                // `a:b@host` names user `a`, which stays readable.
                if template.starts_with("{pw}") && pw.contains(':') {
                    continue;
                }
                let input = if template.contains("'{pw}") {
                    template.replace("{pw}", &quoted(pw))
                } else {
                    template.replace("{pw}", pw)
                };
                let shown = redact_url(&input);
                assert!(!shown.contains(MARKER), "{input:?} -> {shown:?}");
                assert!(shown.contains("***"), "{input:?} -> {shown:?}");
            }
        }
    }

    #[test]
    fn reported_urls_keep_everything_but_the_secret() {
        for (input, expected) in [
            ("http://root:s3cret@h:2379", "http://root:***@h:2379"),
            ("redis://u:ab/s3cret@h:x", "redis://u:***@h:x"),
            ("redis://:p%40ss@h:6379/0", "redis://:***@h:6379/0"),
            ("redis://s3cret@h:6379", "redis://***@h:6379"),
            ("root:s3cret@h:2379", "root:***@h:2379"),
            ("etcd://u:p@a:1,b:2", "etcd://u:***@a:1,b:2"),
            // A user name that would only come from a guessed split is masked too.
            ("redis://a/b:c@h", "redis://***@h"),
            // A lone user name may be a token (`https://TOKEN@host`).
            ("postgres://app@h/db", "postgres://***@h/db"),
            (
                "postgres://u:p@h/db?password=p&sslmode=require",
                "postgres://u:***@h/db?password=***",
            ),
            (
                "postgres://h/db?sslmode=require&password=a&b",
                "postgres://h/db?sslmode=require&password=***",
            ),
            (
                "host=h password='a b\\' c' user=u",
                "host=h password=*** user=u",
            ),
            ("host=h password=a b user=u", "host=h password=***"),
            ("host=h passwordx=a", "host=h passwordx=a"),
        ] {
            assert_eq!(redact_url(input), expected, "{input:?}");
        }
    }

    #[test]
    fn text_without_credentials_is_unchanged() {
        for input in [
            "",
            "redis://127.0.0.1:6379/0",
            "postgres://db.example:5432/app?sslmode=verify-full",
            "etcd://a:1,b:2",
            "localhost:6379",
            "host=h port=5432 user=u",
            "not a url",
            "über://ä€",
        ] {
            assert_eq!(redact_url(input), input);
        }
    }

    #[test]
    fn never_panics_on_odd_input() {
        for input in [
            "@",
            "://@",
            "a://",
            "://",
            ":@",
            "?password=",
            "password='",
            "password=\\",
            "x=y password",
            "€@€",
            "é://ü:ö@ä",
            "password='\\",
            "&&==??##@@::",
        ] {
            let shown = redact_url(input);
            assert!(shown.len() <= input.len() + 3, "{input:?} -> {shown:?}");
        }
    }
}
