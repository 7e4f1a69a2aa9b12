//! Kubernetes resource quantities, parsed with apimachinery's semantics, and the
//! GPU-memory request they carry.
//!
//! Kubernetes rewrites every quantity into a canonical form before anyone reads it:
//! a pod asking for `nvidia.com/gpumem: "12000"` reaches the extender as `"12k"`,
//! `"1024Mi"` as `"1Gi"`, `"0.5Gi"` as `"512Mi"`. A reading of the request must
//! therefore give the same answer for every spelling of the same quantity, which
//! rules out "a plain number is MiB, a suffixed one is bytes": `12k` *is* the
//! plain number 12000.
//!
//! The rule iadeep uses, invariant under canonicalisation because Kubernetes keeps
//! a quantity's format (decimal or binary) when it rewrites it:
//!
//! - a **decimal** quantity (no suffix, a decimal SI suffix `n u m k M G T P E`, or an
//!   exponent `e3` / `E3`) is a number of **MiB**, the convention of GPU-sharing
//!   device plugins: `12000`, `12k` and `12e3` all ask for 12,000 MiB;
//! - a **binary** quantity (`Ki Mi Gi Ti Pi Ei`) is a number of **bytes**: `12Gi`
//!   asks for 12,288 MiB.
//!
//! Fractions of a MiB round up. (One corner is out of reach of any reading: a
//! binary quantity below 1,024 bytes, or not a whole number of KiB, loses its
//! suffix in the canonical form, e.g. `0.5Ki` becomes `512`. GPU memory is never
//! requested with sub-KiB precision.)

use std::fmt;

/// How a quantity was written, which Kubernetes preserves when it canonicalises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// No suffix or a decimal SI suffix (`m`, `k`, `M`, ...).
    DecimalSi,
    /// A decimal exponent (`1e3`, `5E-2`).
    DecimalExponent,
    /// A binary SI suffix (`Ki`, `Mi`, ...).
    BinarySi,
}

/// A parsed quantity: `mantissa × 10^exp10 × 2^exp2`, with its sign and format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quantity {
    negative: bool,
    mantissa: u128,
    exp10: i32,
    exp2: u32,
    format: Format,
}

/// Why a text is not a quantity, or a quantity not a GPU-memory request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error(
        "{0:?} is not a Kubernetes quantity (a number with an optional suffix such as 12k, 12Gi or 1e3)"
    )]
    Format(String),
    #[error(
        "{0:?} has an unknown suffix {1:?} (decimal: n u m k M G T P E, binary: Ki Mi Gi Ti Pi Ei, or an exponent e3)"
    )]
    Suffix(String, String),
    #[error("{0:?} is negative")]
    Negative(String),
    #[error("{0:?} is out of range")]
    Range(String),
}

/// Most mantissa digits kept exactly (u128 holds 38).
const MAX_DIGITS: usize = 38;

impl Quantity {
    /// Parses `text` as apimachinery's `ParseQuantity` does (surrounding blanks, which
    /// its JSON decoding trims, are ignored).
    pub fn parse(text: &str) -> Result<Quantity, QuantityError> {
        let original = text;
        let text = text.trim();
        let format_error = || QuantityError::Format(original.to_owned());
        let (negative, rest) = match text.as_bytes().first() {
            Some(b'-') => (true, &text[1..]),
            Some(b'+') => (false, &text[1..]),
            _ => (false, text),
        };
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(number_end);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(format_error());
        }
        // Leading zeros carry nothing; trailing zeros of the fraction neither.
        let digits = format!("{whole}{fraction}");
        let fraction_len = fraction.len();
        let trimmed = digits.trim_start_matches('0');
        let mut exp10 = -i32::try_from(fraction_len).map_err(|_| format_error())?;
        let mut significant = trimmed.to_owned();
        while significant.len() > 1 && significant.ends_with('0') && exp10 < 0 {
            significant.pop();
            exp10 += 1;
        }
        if significant.len() > MAX_DIGITS {
            return Err(QuantityError::Range(original.to_owned()));
        }
        let mantissa: u128 = if significant.is_empty() {
            0
        } else {
            significant.parse().map_err(|_| format_error())?
        };
        let (format, suffix_exp10, exp2) = match suffix {
            "" => (Format::DecimalSi, 0, 0),
            "n" => (Format::DecimalSi, -9, 0),
            "u" => (Format::DecimalSi, -6, 0),
            "m" => (Format::DecimalSi, -3, 0),
            "k" => (Format::DecimalSi, 3, 0),
            "M" => (Format::DecimalSi, 6, 0),
            "G" => (Format::DecimalSi, 9, 0),
            "T" => (Format::DecimalSi, 12, 0),
            "P" => (Format::DecimalSi, 15, 0),
            "E" => (Format::DecimalSi, 18, 0),
            "Ki" => (Format::BinarySi, 0, 10),
            "Mi" => (Format::BinarySi, 0, 20),
            "Gi" => (Format::BinarySi, 0, 30),
            "Ti" => (Format::BinarySi, 0, 40),
            "Pi" => (Format::BinarySi, 0, 50),
            "Ei" => (Format::BinarySi, 0, 60),
            other => match other.strip_prefix(['e', 'E']) {
                Some(exponent) if is_signed_integer(exponent) => {
                    let exponent: i32 = exponent.parse().map_err(|_| {
                        // A syntactically valid exponent too large for i32.
                        QuantityError::Range(original.to_owned())
                    })?;
                    (Format::DecimalExponent, exponent, 0)
                }
                _ => {
                    return Err(QuantityError::Suffix(original.to_owned(), other.to_owned()));
                }
            },
        };
        exp10 = exp10
            .checked_add(suffix_exp10)
            .ok_or_else(|| QuantityError::Range(original.to_owned()))?;
        Ok(Quantity {
            negative: negative && mantissa != 0,
            mantissa,
            exp10,
            exp2,
            format,
        })
    }

    /// How it was written.
    pub fn format(&self) -> Format {
        self.format
    }

    /// The quantity as a GPU-memory request in MiB, rounded up: decimal quantities
    /// are MiB, binary ones bytes (see the module documentation).
    pub fn gpu_memory_mib(&self) -> Result<u64, QuantityError> {
        let text = || self.to_string();
        if self.negative {
            return Err(QuantityError::Negative(text()));
        }
        // value in MiB = mantissa × 10^exp10 × 2^(exp2 − 20 for bytes).
        let exp2 = match self.format {
            Format::BinarySi => i64::from(self.exp2) - 20,
            Format::DecimalSi | Format::DecimalExponent => 0,
        };
        ceil_scaled(self.mantissa, self.exp10, exp2).ok_or_else(|| QuantityError::Range(text()))
    }
}

/// `ceil(mantissa × 10^exp10 × 2^exp2)` as a u64, or `None` when it does not fit.
fn ceil_scaled(mantissa: u128, exp10: i32, exp2: i64) -> Option<u64> {
    if mantissa == 0 {
        return Some(0);
    }
    let mut numerator = mantissa;
    let mut denominator: u128 = 1;
    let pow10 = |e: u32| 10u128.checked_pow(e);
    if exp10 >= 0 {
        numerator = numerator.checked_mul(pow10(exp10.unsigned_abs())?)?;
    } else {
        match pow10(exp10.unsigned_abs()) {
            Some(d) => denominator = d,
            // Smaller than 10^-38 of a MiB, and positive: one MiB after rounding up.
            None => return Some(1),
        }
    }
    if exp2 >= 0 {
        numerator = numerator.checked_mul(1u128.checked_shl(u32::try_from(exp2).ok()?)?)?;
    } else {
        denominator = denominator.checked_mul(1u128.checked_shl(u32::try_from(-exp2).ok()?)?)?;
    }
    u64::try_from(numerator.div_ceil(denominator)).ok()
}

fn is_signed_integer(text: &str) -> bool {
    let digits = text.strip_prefix(['+', '-']).unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

impl fmt::Display for Quantity {
    /// A plain rendering for messages (`-`, digits, `e` exponent, binary suffix).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.negative { "-" } else { "" };
        let binary = match self.exp2 {
            10 => "Ki",
            20 => "Mi",
            30 => "Gi",
            40 => "Ti",
            50 => "Pi",
            60 => "Ei",
            _ => "",
        };
        if self.exp10 == 0 {
            write!(f, "{sign}{}{binary}", self.mantissa)
        } else {
            write!(f, "{sign}{}e{}{binary}", self.mantissa, self.exp10)
        }
    }
}

/// Parses a GPU-memory quantity as it appears in a pod and converts it to MiB.
pub fn gpu_memory_mib(text: &str) -> Result<u64, QuantityError> {
    Quantity::parse(text)?.gpu_memory_mib()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every canonical form Kubernetes writes, and the spellings users write, as MiB.
    #[test]
    fn canonical_forms_table() {
        let table: &[(&str, u64)] = &[
            // Decimal quantities are MiB, however Kubernetes spells them.
            ("12000", 12_000),
            ("12k", 12_000),
            ("12e3", 12_000),
            ("1e3", 1_000),
            ("1E3", 1_000),
            ("1.2e4", 12_000),
            ("120e2", 12_000),
            ("0.012M", 12_000),
            ("+12k", 12_000),
            ("  12k ", 12_000),
            ("16384", 16_384),
            ("1M", 1_000_000),
            ("1G", 1_000_000_000),
            ("1T", 1_000_000_000_000),
            ("1P", 1_000_000_000_000_000),
            ("2E", 2_000_000_000_000_000_000),
            ("1.5k", 1_500),
            ("0", 0),
            ("0k", 0),
            ("-0", 0),
            ("000120", 120),
            ("12.", 12),
            (".5k", 500),
            // Fractions of a MiB round up.
            ("100m", 1),
            ("1500m", 2),
            ("1u", 1),
            ("1n", 1),
            ("0.5", 1),
            ("1e-3", 1),
            ("1e-50", 1),
            // Binary quantities are bytes.
            ("12Ki", 1),
            ("1024Ki", 1),
            ("1025Ki", 2),
            ("512Mi", 512),
            ("12Gi", 12_288),
            ("1.5Gi", 1_536),
            ("0.5Gi", 512),
            ("1Ti", 1 << 20),
            ("1Pi", 1 << 30),
            ("1Ei", 1 << 40),
        ];
        for &(text, mib) in table {
            assert_eq!(gpu_memory_mib(text), Ok(mib), "{text}");
        }
    }

    /// Kubernetes canonicalises quantities before the extender sees them; the reading
    /// of the canonical form must equal the reading of what the user wrote.
    #[test]
    fn a_quantity_and_its_canonical_form_ask_for_the_same_memory() {
        for (written, canonical) in [
            ("12000", "12k"),
            ("16000", "16k"),
            ("1000000", "1M"),
            ("12e3", "12e3"),
            ("12288Mi", "12Gi"),
            ("1024Mi", "1Gi"),
            ("1.5Gi", "1536Mi"),
            ("0.5Gi", "512Mi"),
            ("0.1", "100m"),
            ("1.5k", "1500"),
        ] {
            assert_eq!(
                gpu_memory_mib(written),
                gpu_memory_mib(canonical),
                "{written} vs {canonical}"
            );
        }
    }

    #[test]
    fn formats_are_kept() {
        let format = |t: &str| Quantity::parse(t).map(|q| q.format());
        assert_eq!(format("12k"), Ok(Format::DecimalSi));
        assert_eq!(format("12"), Ok(Format::DecimalSi));
        assert_eq!(format("12e3"), Ok(Format::DecimalExponent));
        assert_eq!(format("12Gi"), Ok(Format::BinarySi));
        // A bare E is exa, not an exponent.
        assert_eq!(format("3E"), Ok(Format::DecimalSi));
    }

    #[test]
    fn malformed_quantities_are_refused_with_the_reason() {
        for text in [
            "", " ", ".", "-", "+", "k", "Gi", "e3", "1.2.3", "12 k", "1 2", "4 GB", "4GB", "12kB",
            "1e", "1e+", "1Ki3", "0x10", "1,5", "12KI", "12K", "1_000", "∞",
        ] {
            let err = gpu_memory_mib(text).expect_err(text);
            assert!(
                matches!(err, QuantityError::Format(_) | QuantityError::Suffix(..)),
                "{text}: {err}"
            );
        }
        assert!(matches!(
            gpu_memory_mib("-1"),
            Err(QuantityError::Negative(_))
        ));
        assert!(matches!(
            gpu_memory_mib("-12Gi"),
            Err(QuantityError::Negative(_))
        ));
        for text in [
            "20E",
            "1e400",
            "1e20",
            "16Ei0",
            "99999999999999999999999999999999999999999",
        ] {
            let err = gpu_memory_mib(text).expect_err(text);
            assert!(
                matches!(err, QuantityError::Range(_) | QuantityError::Suffix(..)),
                "{text}: {err}"
            );
        }
        let message = gpu_memory_mib("4GB").expect_err("4GB").to_string();
        assert!(message.contains("unknown suffix \"GB\""), "{message}");
    }
}
