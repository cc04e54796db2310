//! `--spine` and `--memory-budget` of `convert` and `install`: the spine matrices' precision, or
//! `auto`, which weighs the bf16 spine against the memory the runtime will have.

use deltafin_engine::plan::{Budget, default_budget, parse_size};
use deltafin_store::{SpineDtype, SpinePrecision};

/// A `--spine` value: `auto` or a dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpineArg {
    Auto,
    Fixed(SpineDtype),
}

impl std::str::FromStr for SpineArg {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(SpineArg::Auto),
            _ => s
                .parse()
                .map(SpineArg::Fixed)
                .map_err(|_| format!("unknown spine '{s}' (expected auto, int8, bf16 or f32)")),
        }
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct SpineArgs {
    /// Storage of spine matrices: auto, int8 (per-row scales), bf16 or f32. auto keeps the
    /// checkpoint's bf16 when the bf16 spine takes at most half the memory budget, else int8
    /// (int8 changes a trained model's top token at 2-3% of positions: docs/numerics.md "Spine
    /// quantisation").
    #[arg(long, default_value = "auto")]
    pub spine: SpineArg,
    /// The memory budget `--spine auto` weighs the spine against (e.g. 64G): that of the machine
    /// that will run the store. Default: this machine's default budget (85% of available memory,
    /// or of the headroom under this process' cgroup limit).
    #[arg(long, value_parser = parse_size)]
    pub memory_budget: Option<u64>,
}

impl SpineArgs {
    /// The precision to ask `convert` for, and for `auto` the budget's origin in words. A budget
    /// given with a fixed dtype would be ignored: it is refused instead.
    pub fn precision(&self) -> anyhow::Result<(SpinePrecision, Option<String>)> {
        match (self.spine, self.memory_budget) {
            (SpineArg::Fixed(_), Some(_)) => {
                anyhow::bail!(
                    "--memory-budget is what --spine auto weighs; with --spine int8, bf16 or f32 it has no use"
                )
            }
            (SpineArg::Fixed(d), None) => Ok((SpinePrecision::Fixed(d), None)),
            (SpineArg::Auto, given) => {
                let b = given.map_or_else(default_budget, Budget::given);
                Ok((SpinePrecision::Auto { budget: b.bytes }, Some(b.source)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_auto_and_dtypes_and_refuses_others() {
        assert_eq!("auto".parse::<SpineArg>(), Ok(SpineArg::Auto));
        assert_eq!("bf16".parse::<SpineArg>(), Ok(SpineArg::Fixed(SpineDtype::Bf16)));
        assert_eq!("int8".parse::<SpineArg>(), Ok(SpineArg::Fixed(SpineDtype::Int8)));
        assert!("int4".parse::<SpineArg>().unwrap_err().contains("expected auto, int8, bf16 or f32"));
    }

    #[test]
    fn auto_takes_the_given_budget() {
        let a = SpineArgs { spine: SpineArg::Auto, memory_budget: Some(1 << 30) };
        assert_eq!(a.precision().unwrap().0, SpinePrecision::Auto { budget: 1 << 30 });
        let f = SpineArgs { spine: SpineArg::Fixed(SpineDtype::Int8), memory_budget: None };
        assert_eq!(f.precision().unwrap(), (SpinePrecision::Fixed(SpineDtype::Int8), None));
        let both = SpineArgs { spine: SpineArg::Fixed(SpineDtype::Int8), memory_budget: Some(1 << 30) };
        assert!(both.precision().unwrap_err().to_string().contains("--spine auto"));
    }
}
