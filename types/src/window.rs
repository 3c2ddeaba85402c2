//! Limit windows: `30s`, `1m`, `1h`, `1d` (a positive whole number and one unit).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Longest window accepted: one year. Longer ones are almost certainly a typo.
pub const MAX_WINDOW_SECONDS: u64 = 366 * 86_400;

/// A fixed window length in seconds, written as `<n><s|m|h|d>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Window {
    seconds: u64,
}

impl Window {
    pub fn from_seconds(seconds: u64) -> Result<Self, String> {
        if seconds == 0 {
            return Err("window must be longer than 0".into());
        }
        if seconds > MAX_WINDOW_SECONDS {
            return Err(format!(
                "window must be at most {MAX_WINDOW_SECONDS}s (366d)"
            ));
        }
        Ok(Window { seconds })
    }

    pub fn seconds(&self) -> u64 {
        self.seconds
    }

    /// Parses `<n><unit>`; units s, m, h, d.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let unit_at = s
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| format!("window {s:?} needs a unit (s, m, h or d), e.g. 1m"))?;
        let (num, unit) = s.split_at(unit_at);
        if num.is_empty() {
            return Err(format!("window {s:?} must start with a number, e.g. 1m"));
        }
        let n: u64 = num
            .parse()
            .map_err(|_| format!("window {s:?}: number too large"))?;
        let mult = match unit {
            "s" => 1,
            "m" => 60,
            "h" => 3_600,
            "d" => 86_400,
            _ => return Err(format!("window {s:?}: unit must be s, m, h or d")),
        };
        let seconds = n
            .checked_mul(mult)
            .ok_or_else(|| format!("window {s:?}: too long"))?;
        Window::from_seconds(seconds).map_err(|e| format!("window {s:?}: {e}"))
    }

    /// Start (unix seconds) of the fixed window that holds `now`.
    pub fn start_of(&self, now_unix: u64) -> u64 {
        now_unix - now_unix % self.seconds
    }

    /// Seconds from `now` to the end of the window that holds it (at least 1).
    pub fn seconds_left(&self, now_unix: u64) -> u64 {
        self.start_of(now_unix) + self.seconds - now_unix
    }
}

impl std::fmt::Display for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.seconds;
        if s.is_multiple_of(86_400) {
            write!(f, "{}d", s / 86_400)
        } else if s.is_multiple_of(3_600) {
            write!(f, "{}h", s / 3_600)
        } else if s.is_multiple_of(60) {
            write!(f, "{}m", s / 60)
        } else {
            write!(f, "{s}s")
        }
    }
}

impl Serialize for Window {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Window {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        Window::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_units() {
        assert_eq!(Window::parse("30s").unwrap().seconds(), 30);
        assert_eq!(Window::parse("1m").unwrap().seconds(), 60);
        assert_eq!(Window::parse("2h").unwrap().seconds(), 7_200);
        assert_eq!(Window::parse("1d").unwrap().seconds(), 86_400);
    }

    #[test]
    fn rejects_bad() {
        for bad in [
            "",
            "0m",
            "m",
            "1",
            "1w",
            "-1m",
            "1.5m",
            "99999999999999999999s",
            "400d",
        ] {
            assert!(Window::parse(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn window_arithmetic() {
        let w = Window::parse("1m").unwrap();
        assert_eq!(w.start_of(125), 120);
        assert_eq!(w.seconds_left(125), 55);
        assert_eq!(w.seconds_left(120), 60);
    }

    proptest! {
        #[test]
        fn display_roundtrips(secs in 1u64..=MAX_WINDOW_SECONDS) {
            let w = Window::from_seconds(secs).unwrap();
            prop_assert_eq!(Window::parse(&w.to_string()).unwrap(), w);
        }

        #[test]
        fn parse_never_panics(s in ".{0,24}") {
            let _ = Window::parse(&s);
        }
    }
}
