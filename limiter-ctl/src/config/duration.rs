//! Durations written as text, read exactly: a decimal number with a fraction times its unit is
//! computed to the nanosecond, rounded down, and anything beyond 2^128 ns is refused, never
//! wrapped. One arithmetic ([`scaled_ns`]) for the two grammars that meet a ban's duration:
//! `--for`'s ([`duration_ns`], humantime's units) and CrowdSec's Go durations (the bouncer's).

/// `int.frac` (ASCII digits each, `frac` possibly empty) times `unit_ns`, exactly, rounded down
/// to the nanosecond; None beyond u128.
pub fn scaled_ns(int: &str, frac: &str, unit_ns: u128) -> Option<u128> {
    let mut whole: u128 = 0;
    for d in int.bytes() {
        whole = whole.checked_mul(10)?.checked_add(u128::from(d.checked_sub(b'0').filter(|d| *d < 10)?))?;
    }
    // The fraction by long division from its last digit: each step's floor is the floor of the
    // exact value, whatever the number of digits (floor((n + floor(x)) / 10) = floor((n + x) / 10)
    // for a whole n), and every value stays below `unit_ns`.
    let mut part: u128 = 0;
    for d in frac.bytes().rev() {
        let d = u128::from(d.checked_sub(b'0').filter(|d| *d < 10)?);
        part = (d * unit_ns + part) / 10;
    }
    whole.checked_mul(unit_ns)?.checked_add(part)
}

/// A unit of [`duration_ns`]: humantime's names (`m` a minute, `M` a month of 30.44 days, `y`
/// a year of 365.25 days).
fn unit_ns(unit: &str) -> Option<u128> {
    const S: u128 = 1_000_000_000;
    Some(match unit {
        "nanos" | "nsec" | "ns" => 1,
        "usec" | "us" | "µs" => 1_000,
        "millis" | "msec" | "ms" => 1_000_000,
        "seconds" | "second" | "secs" | "sec" | "s" => S,
        "minutes" | "minute" | "min" | "mins" | "m" => 60 * S,
        "hours" | "hour" | "hr" | "hrs" | "h" => 3_600 * S,
        "days" | "day" | "d" => 86_400 * S,
        "weeks" | "week" | "wk" | "wks" | "w" => 7 * 86_400 * S,
        "months" | "month" | "M" => 2_630_016 * S,
        "years" | "year" | "y" => 31_557_600 * S,
        _ => return None,
    })
}

/// A duration in ns: one or more `NUMBER[.FRACTION]UNIT` (`1h30m`, `1.5h`, `90 s`, spaces
/// between parts allowed), or a bare whole number of seconds (fail2ban's `<bantime>`). None for
/// anything else (a sign, an empty number, an unknown unit) and beyond 2^128 ns.
pub fn duration_ns(s: &str) -> Option<u128> {
    if let Some(secs) = super::decimal(s) {
        return Some(u128::from(secs) * 1_000_000_000);
    }
    let mut rest = s.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let (int, after) = rest.split_at(int_len);
        let (frac, after) = match after.strip_prefix('.') {
            Some(a) => match a.bytes().take_while(u8::is_ascii_digit).count() {
                0 => return None,
                n => a.split_at(n),
            },
            None => ("", after),
        };
        if int.is_empty() {
            return None;
        }
        let unit_len = after.find(|c: char| c.is_ascii_digit() || c.is_whitespace()).unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        total = total.checked_add(scaled_ns(int, frac, unit_ns(unit)?)?)?;
        rest = after.trim_start();
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u128 = 1_000_000_000;

    #[test]
    fn fractions_are_exact_to_the_nanosecond() {
        assert_eq!(scaled_ns("0", "99999999999999999999999999", 3_600 * S), Some(3_600 * S - 1));
        assert_eq!(scaled_ns("0", &"9".repeat(200), 3_600 * S), Some(3_600 * S - 1), "any number of digits");
        assert_eq!(scaled_ns("1", "5", 3_600 * S), Some(5_400 * S));
        assert_eq!(scaled_ns("0", "333", 3_600 * S), Some(1_198_800_000_000));
        assert_eq!(scaled_ns("0", "0000000001", S), Some(0), "below a nanosecond: rounded down");
        assert_eq!(scaled_ns("2", "", 60 * S), Some(120 * S));
        assert_eq!(scaled_ns(&"9".repeat(40), "", S), None, "beyond u128: refused, not wrapped");
        assert_eq!(scaled_ns("1a", "", S), None);
    }

    #[test]
    fn durations_read_as_written_or_not_at_all() {
        for (text, ns) in [
            ("600", 600 * S),
            ("0", 0),
            ("10m", 600 * S),
            ("1h30m", 5_400 * S),
            ("1h 30m", 5_400 * S),
            ("1.5h", 5_400 * S),
            ("0.99999999999999999999999999h", 3_600 * S - 1),
            ("2days", 172_800 * S),
            ("1M", 2_630_016 * S),
            ("250ms", S / 4),
            ("0s", 0),
        ] {
            assert_eq!(duration_ns(text), Some(ns), "{text}");
        }
        for bad in ["", " ", "-5s", "+5s", "05x", "5x", "h", ".5h", "5.h", "1h-30m", "0x10s", "1e3s", "soon"] {
            assert_eq!(duration_ns(bad), None, "{bad}");
        }
        assert_eq!(duration_ns(&format!("{}y", "9".repeat(30))), None, "huge: refused");
    }
}
