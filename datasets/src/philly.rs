//! The Microsoft Philly job trace (Jeon et al., USENIX ATC 2019), as processed
//! by the adaptdl project: one row per job with its submit time, duration and
//! GPU count.
//!
//! The simulator takes arrival times and durations from it, so the workload's
//! burstiness and heavy-tailed durations are measured, not invented.

use crate::DatasetError;
use crate::csv_text::read_records;

/// The trace shipped in the repository (`data/traces/philly.csv`, CC-BY-4.0).
pub const BUNDLED: &str = include_str!("../../data/traces/philly.csv");

/// One job of the trace.
#[derive(Clone, Debug, PartialEq)]
pub struct PhillyJob {
    /// Submit time, seconds since the Unix epoch (UTC).
    pub submit_unix_s: i64,
    /// Run time, seconds.
    pub duration_s: f64,
    pub num_gpus: u32,
    /// GPU-seconds (`duration × num_gpus` in this processed trace).
    pub gpu_time_s: f64,
    /// Virtual cluster id.
    pub cluster: String,
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parses `YYYY-MM-DD HH:MM:SS` (UTC) into seconds since the epoch.
pub fn parse_timestamp(text: &str) -> Result<i64, DatasetError> {
    let bad = || DatasetError::Format(format!("bad timestamp {text:?}"));
    let (date, time) = text.trim().split_once(' ').ok_or_else(bad)?;
    let date: Vec<i64> = date
        .split('-')
        .map(|p| p.parse::<i64>().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let time: Vec<i64> = time
        .split(':')
        .map(|p| p.parse::<i64>().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let ([year, month, day], [hour, minute, second]) = (date.as_slice(), time.as_slice()) else {
        return Err(bad());
    };
    if !(1..=12).contains(month)
        || !(1..=31).contains(day)
        || !(0..24).contains(hour)
        || !(0..60).contains(minute)
        || !(0..=60).contains(second)
    {
        return Err(bad());
    }
    Ok(days_from_civil(*year, *month, *day) * 86_400 + hour * 3_600 + minute * 60 + second)
}

/// Parses the CSV text of a Philly trace (`timestamp,duration,num_gpus,gpu_time,cluster`).
/// Rows keep the file's order (the published file is not sorted by time).
pub fn parse(text: &str) -> Result<Vec<PhillyJob>, DatasetError> {
    let header = ["timestamp", "duration", "num_gpus", "gpu_time", "cluster"];
    read_records(text, &header)?
        .iter()
        .map(|record| {
            let seconds = |column: &str| -> Result<f64, DatasetError> {
                let value: f64 = record.parse(column, "a number of seconds")?;
                if value.is_finite() && value >= 0.0 {
                    Ok(value)
                } else {
                    Err(record
                        .error(
                            column,
                            &format!("expected a non-negative number, got {value}"),
                        )
                        .into())
                }
            };
            let timestamp = record.get("timestamp")?;
            Ok(PhillyJob {
                submit_unix_s: parse_timestamp(timestamp).map_err(|_| {
                    record.error(
                        "timestamp",
                        &format!("expected `YYYY-MM-DD HH:MM:SS`, got {timestamp:?}"),
                    )
                })?,
                duration_s: seconds("duration")?,
                num_gpus: record.parse("num_gpus", "a GPU count")?,
                gpu_time_s: seconds("gpu_time")?,
                cluster: record.get("cluster")?.to_owned(),
            })
        })
        .collect()
}

/// The bundled trace, parsed.
pub fn bundled() -> Result<Vec<PhillyJob>, DatasetError> {
    parse(BUNDLED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_utc_seconds() {
        assert_eq!(parse_timestamp("1970-01-01 00:00:00").expect("ok"), 0);
        assert_eq!(
            parse_timestamp("2017-10-09 07:01:55").expect("ok"),
            1_507_532_515
        );
        for bad in ["2017-13-01 00:00:00", "2017-10-09", "2017-10-09 7:x:00", ""] {
            assert!(parse_timestamp(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bundled_trace_parses_and_is_mostly_single_gpu() {
        let jobs = bundled().expect("bundled trace parses");
        assert_eq!(jobs.len(), 82_247);
        let single = jobs.iter().filter(|j| j.num_gpus == 1).count();
        assert!(single > jobs.len() * 9 / 10, "{single}");
        assert!(jobs.iter().all(|j| j.duration_s >= 0.0));
    }

    #[test]
    fn malformed_rows_are_errors() {
        let header = "timestamp,duration,num_gpus,gpu_time,cluster\n";
        for body in [
            "2017-10-09 07:01:55,66.0,1,66.0",
            "2017-10-09 07:01:55,-1,1,66.0,a",
            "2017-10-09 07:01:55,66.0,x,66.0,a",
            "yesterday,66.0,1,66.0,a",
        ] {
            assert!(parse(&format!("{header}{body}")).is_err(), "{body}");
        }
        assert!(parse("a,b\n").is_err());
        assert_eq!(
            parse(&format!("{header}2017-10-09 07:01:55,66.0,1,66.0,11cb48\n"))
                .expect("ok")
                .len(),
            1
        );
    }

    #[test]
    fn quoted_fields_are_read_whole() {
        let header = "timestamp,duration,num_gpus,gpu_time,cluster\n";
        let jobs = parse(&format!(
            "{header}\"2017-10-09 07:01:55\",66.0,1,66.0,\"vc, east\"\n"
        ))
        .expect("ok");
        assert_eq!(jobs[0].cluster, "vc, east");
        assert_eq!(jobs[0].submit_unix_s, 1_507_532_515);
        let error = parse(&format!(
            "{header}\n2017-10-09 07:01:55,\"66,0\",1,66.0,a\n"
        ))
        .expect_err("66,0 is one field, not a number");
        assert!(
            error.to_string().contains("line 3, column duration"),
            "{error}"
        );
    }
}
