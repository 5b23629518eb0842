//! The dates chat templates print: `strftime_now(format)` (Hugging Face's renderer offers it;
//! Llama 3.1+ templates print "Today Date: 26 Jul 2024"), and the variables llama.cpp gives
//! every template, `date_string` ("04 Dec 2026") and `datetime` ("Dec 04 2026"). UTC, from
//! the system clock, with no time-zone database.

/// English month names, as `%B` prints them (`%b`: their first three letters).
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// `strftime_now(format)`, as Hugging Face's renderer offers (Llama 3.1+ templates print the
/// date). Supports the directives those templates use.
pub(crate) fn strftime_now(format: String) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime_at(&format, now)
}

/// `format` printed for the moment `unix_secs` (UTC): what `strftime_now` prints, for a clock
/// given explicitly.
fn strftime_at(format: &str, unix_secs: u64) -> String {
    let (year, month, day) = civil_from_days((unix_secs / 86_400) as i64);
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month, day) of a day count since 1970-01-01 (Howard Hinnant's algorithm).
pub(crate) fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The variables llama.cpp's server gives every template besides the conversation: today's
/// date as `date_string` (`%d %b %Y`, which Llama 3.x templates print when it is defined) and
/// `datetime` (`%b %d %Y`, Firefunction's).
pub(crate) fn date_variables() -> [(&'static str, String); 2] {
    [
        ("date_string", strftime_now("%d %b %Y".into())),
        ("datetime", strftime_now("%b %d %Y".into())),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatTemplate;

    /// (year, month, day) of day `days` since 1970-01-01, counted one day at a time from the
    /// epoch: an independent check of `civil_from_days`.
    fn walk_calendar(from: i64, to: i64) -> Vec<(i64, u32, u32)> {
        let leap = |y: i64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
        let month_len = |y: i64, m: u32| match m {
            2 if leap(y) => 29,
            2 => 28,
            4 | 6 | 9 | 11 => 30,
            _ => 31,
        };
        assert!(from <= 0 && to >= 0);
        let mut forward = vec![(1970, 1, 1)];
        let (mut y, mut m, mut d) = (1970_i64, 1_u32, 1_u32);
        for _ in 0..to {
            d += 1;
            if d > month_len(y, m) {
                d = 1;
                m += 1;
                if m > 12 {
                    m = 1;
                    y += 1;
                }
            }
            forward.push((y, m, d));
        }
        let mut backward = Vec::new();
        let (mut y, mut m, mut d) = (1970_i64, 1_u32, 1_u32);
        for _ in from..0 {
            if d == 1 {
                if m == 1 {
                    m = 12;
                    y -= 1;
                } else {
                    m -= 1;
                }
                d = month_len(y, m);
            } else {
                d -= 1;
            }
            backward.push((y, m, d));
        }
        backward.reverse();
        backward.extend(forward);
        backward
    }

    #[test]
    fn civil_from_days_matches_the_calendar() {
        // Fixed dates, leap days and century rules included.
        for (days, date) in [
            (0, (1970, 1, 1)),
            (-1, (1969, 12, 31)),
            (59, (1970, 3, 1)),
            (11_016, (2000, 2, 29)),
            (11_017, (2000, 3, 1)),
            (20_088, (2024, 12, 31)),
            (47_541, (2100, 3, 1)),
            (-25_508, (1900, 3, 1)),
            (-135_081, (1600, 2, 29)),
        ] {
            assert_eq!(civil_from_days(days), date, "day {days}");
        }
        // Every day from 1696 to 2243.
        let (from, to) = (-100_000, 100_000);
        for (i, date) in walk_calendar(from, to).into_iter().enumerate() {
            let days = from + i as i64;
            assert_eq!(civil_from_days(days), date, "day {days}");
        }
    }

    /// What `strftime_now(format)` must give on day `days` since the epoch.
    fn expected_strftime(days: i64) -> String {
        let (y, m, d) = walk_calendar(0, days)[days as usize];
        let name = MONTHS[m as usize - 1];
        format!(
            "{d:02}|{m:02}|{y}|{:02}|{name}|{}|%|%Q|%",
            y % 100,
            &name[..3]
        )
    }

    fn today() -> i64 {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        (secs / 86_400) as i64
    }

    #[test]
    fn strftime_at_a_fixed_clock() {
        // 2024-07-26 13:05:09 UTC, the date Llama 3.1's template example prints.
        let t = 1_722_000_309;
        assert_eq!(
            strftime_at("%d|%m|%Y|%y|%B|%b|%%|%Q|%", t),
            "26|07|2024|24|July|Jul|%|%Q|%"
        );
        assert_eq!(
            strftime_at("Today Date: %d %b %Y", 0),
            "Today Date: 01 Jan 1970"
        );
        // A leap day, and the last second before a new year.
        assert_eq!(strftime_at("%d %B %Y", 1_709_164_800), "29 February 2024");
        assert_eq!(strftime_at("%d %m %Y", 1_735_689_599), "31 12 2024");
        for days in [0i64, 59, 365, 11_016, 19_930, 20_000] {
            let secs = u64::try_from(days).unwrap() * 86_400 + 86_399;
            let format = "%d|%m|%Y|%y|%B|%b|%%|%Q|%";
            assert_eq!(
                strftime_at(format, secs),
                expected_strftime(days),
                "day {days}"
            );
        }
    }

    #[test]
    fn strftime_now_prints_the_current_date_in_every_directive() {
        // The clock is read inside strftime_now: bracket the call (a day may turn meanwhile)
        // and compare with a calendar walked from the epoch.
        let format = "%d|%m|%Y|%y|%B|%b|%%|%Q|%";
        let before = today();
        let got = strftime_now(format.into());
        let after = today();
        let candidates: Vec<String> = (before..=after).map(expected_strftime).collect();
        assert!(
            candidates.contains(&got),
            "{got:?} is none of {candidates:?}"
        );
        // Through a template, as Llama 3.1's prints "Today Date: 26 Jul 2024".
        let t = ChatTemplate::new("t", "{{ strftime_now('%d %b %Y') }}", "", "").unwrap();
        let before = today();
        let text = t.render(&[], true).unwrap();
        let after = today();
        let candidates: Vec<String> = (before..=after)
            .map(|day| {
                let e = expected_strftime(day);
                let parts: Vec<&str> = e.split('|').collect();
                format!("{} {} {}", parts[0], parts[5], parts[2])
            })
            .collect();
        assert!(
            candidates.contains(&text),
            "{text:?} is none of {candidates:?}"
        );
    }

    #[test]
    fn templates_see_today_as_llama_cpp_gives_it() {
        // Llama 3.x prints date_string when defined, else a fixed date; Firefunction prints
        // datetime.
        let t = ChatTemplate::new(
            "t",
            "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}\
             {%- endif %}{{ date_string }}|{{ datetime }}",
            "",
            "",
        )
        .unwrap();
        let before = today();
        let text = t.render(&[], true).unwrap();
        let after = today();
        let candidates: Vec<String> = (before..=after)
            .map(|day| {
                let e = expected_strftime(day);
                let p: Vec<&str> = e.split('|').collect();
                format!("{} {} {}|{} {} {}", p[0], p[5], p[2], p[5], p[0], p[2])
            })
            .collect();
        assert!(
            candidates.contains(&text),
            "{text:?} is none of {candidates:?}"
        );
    }
}
