//! CSV text read into records addressed by column name, with the `csv` crate.
//!
//! Every reader of a CSV file in iadeep (the Philly trace, the Pollux traces,
//! `iadeep memory eval`) wants the same thing: a fixed header, fields trimmed,
//! blank lines skipped, quoted fields allowed, and errors that name the line
//! and the column.

use std::str::FromStr;

/// What is wrong with a CSV text, and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}{}: {reason}", column_place(.column))]
pub struct CsvError {
    /// Line of the text, counted from 1 (the line where the record starts).
    pub line: u64,
    /// Column name, when the problem is in one field.
    pub column: Option<String>,
    pub reason: String,
}

fn column_place(column: &Option<String>) -> String {
    column
        .as_ref()
        .map(|c| format!(", column {c}"))
        .unwrap_or_default()
}

/// One data row, its fields trimmed.
#[derive(Clone, Debug)]
pub struct CsvRecord<'h> {
    header: &'h [&'h str],
    line: u64,
    fields: csv::StringRecord,
}

impl CsvRecord<'_> {
    /// Line of the text where this record starts, counted from 1.
    pub fn line(&self) -> u64 {
        self.line
    }

    /// The (trimmed) field of `column`.
    pub fn get(&self, column: &str) -> Result<&str, CsvError> {
        self.header
            .iter()
            .position(|c| *c == column)
            .and_then(|i| self.fields.get(i))
            .ok_or_else(|| self.error(column, "no such column"))
    }

    /// The field of `column` parsed as `T`; `expected` says what it should be
    /// in the error ("a positive integer").
    pub fn parse<T: FromStr>(&self, column: &str, expected: &str) -> Result<T, CsvError> {
        let text = self.get(column)?;
        text.parse()
            .map_err(|_| self.error(column, &format!("expected {expected}, got {text:?}")))
    }

    /// An error about the field of `column` in this record.
    pub fn error(&self, column: &str, reason: &str) -> CsvError {
        CsvError {
            line: self.line,
            column: Some(column.to_owned()),
            reason: reason.to_owned(),
        }
    }
}

/// Lines (from 1) of the records of one text, counted as the reader moves on.
///
/// The `csv` crate's own line count, and its offset, can point before the empty
/// lines it skipped; lines are counted as `str::lines` does (a lone `\r` is no
/// line break).
struct LineCounter<'t> {
    text: &'t [u8],
    /// Byte offset up to which `breaks` are counted.
    counted_to: usize,
    breaks: u64,
}

impl<'t> LineCounter<'t> {
    fn new(text: &'t str) -> Self {
        LineCounter {
            text: text.as_bytes(),
            counted_to: 0,
            breaks: 0,
        }
    }

    /// Line of the record that starts at `position` (past any line breaks there).
    fn line(&mut self, position: Option<&csv::Position>) -> u64 {
        let offset = position
            .and_then(|p| usize::try_from(p.byte()).ok())
            .unwrap_or(0);
        let mut start = offset.min(self.text.len());
        while self
            .text
            .get(start)
            .is_some_and(|b| matches!(b, b'\r' | b'\n'))
        {
            start += 1;
        }
        if start < self.counted_to {
            (self.counted_to, self.breaks) = (0, 0);
        }
        let newly = self.text[self.counted_to..start]
            .iter()
            .filter(|b| **b == b'\n')
            .count();
        self.breaks += u64::try_from(newly).unwrap_or(u64::MAX);
        self.counted_to = start;
        self.breaks.saturating_add(1)
    }

    /// The `csv` crate's own errors (with a flexible reader over `&str`, in
    /// practice none: no field-count or UTF-8 errors are possible).
    fn syntax(&mut self, error: &csv::Error) -> CsvError {
        CsvError {
            line: self.line(error.position()),
            column: None,
            reason: error.to_string(),
        }
    }
}

/// A record with one empty field is a line of spaces; the hand-written readers
/// this replaces skipped those too.
fn is_blank(record: &csv::StringRecord) -> bool {
    record.len() == 1 && record.get(0).is_some_and(str::is_empty)
}

/// Reads `text`: the first non-blank line must be exactly `header` (after
/// trimming), every later non-blank line must have as many fields. Fields are
/// trimmed and may be quoted (`"a, b"`, `"say ""hi"""`).
pub fn read_records<'h>(text: &str, header: &'h [&'h str]) -> Result<Vec<CsvRecord<'h>>, CsvError> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .trim(csv::Trim::All)
        .from_reader(text.as_bytes());
    let mut lines = LineCounter::new(text);
    let mut records = reader.records().filter(|r| !r.as_ref().is_ok_and(is_blank));
    let expected = header.join(",");
    let found = match records.next() {
        None => {
            return Err(CsvError {
                line: 1,
                column: None,
                reason: format!("empty CSV, expected the header `{expected}`"),
            });
        }
        Some(found) => found.map_err(|e| lines.syntax(&e))?,
    };
    if found.iter().ne(header.iter().copied()) {
        return Err(CsvError {
            line: lines.line(found.position()),
            column: None,
            reason: format!(
                "expected the header `{expected}`, got `{}`",
                found.iter().collect::<Vec<_>>().join(",")
            ),
        });
    }
    let mut rows = Vec::new();
    for record in records {
        let fields = record.map_err(|e| lines.syntax(&e))?;
        let line = lines.line(fields.position());
        if fields.len() != header.len() {
            return Err(CsvError {
                line,
                column: None,
                reason: format!("{} fields, expected {}", fields.len(), header.len()),
            });
        }
        rows.push(CsvRecord {
            header,
            line,
            fields,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &[&str] = &["name", "size"];

    #[test]
    fn fields_are_trimmed_and_blank_lines_skipped() {
        let records =
            read_records("\n  \n name , size \r\n\n a , 1 \n   \nb,2", HEADER).expect("reads");
        assert_eq!(records.len(), 2);
        assert_eq!(records[0].get("name"), Ok("a"));
        assert_eq!(records[0].line(), 5);
        assert_eq!(records[1].parse::<u32>("size", "a size"), Ok(2));
        assert_eq!(records[1].line(), 7);
    }

    #[test]
    fn quoted_fields_keep_their_commas() {
        let records = read_records("name,size\n\"a, b\",\"3\"\n", HEADER).expect("reads");
        assert_eq!(records[0].get("name"), Ok("a, b"));
        assert_eq!(records[0].parse::<u32>("size", "a size"), Ok(3));
        let records = read_records("name,size\n\"a\nb\",1\n\n\nc,2\n", HEADER).expect("reads");
        assert_eq!(records[0].get("name"), Ok("a\nb"));
        assert_eq!(records[1].line(), 6);
    }

    #[test]
    fn errors_name_the_line_and_column() {
        let error = |text: &str| {
            read_records(text, HEADER)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert_eq!(
            error(""),
            "line 1: empty CSV, expected the header `name,size`"
        );
        assert_eq!(
            error("\nname,weight\n"),
            "line 2: expected the header `name,size`, got `name,weight`"
        );
        assert_eq!(
            error("name,size\na,1\n\nb\n"),
            "line 4: 1 fields, expected 2"
        );
        let records = read_records("name,size\na,x\n", HEADER).expect("reads");
        assert_eq!(
            records[0]
                .parse::<u32>("size", "a size")
                .map_err(|e| e.to_string()),
            Err("line 2, column size: expected a size, got \"x\"".to_owned())
        );
        assert!(records[0].get("weight").is_err());
    }
}
