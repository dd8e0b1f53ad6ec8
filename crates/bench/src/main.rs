//! `spattn-bench`: see the crate documentation of the `spattn_bench` library, or `--help`.

use std::process::ExitCode;

use spattn_bench::cli::{self, Parsed};
use spattn_bench::{outln, report, run, scaling};

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let parsed = match cli::parse(&argv) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("spattn-bench: {e}");
            return ExitCode::from(2);
        }
    };
    match parsed {
        Parsed::Print(text) => {
            outln!("{}", text.trim_end());
            ExitCode::SUCCESS
        }
        Parsed::Report(args) => match report::report(&args) {
            Ok(paths) => {
                for p in paths {
                    outln!("wrote {}", p.display());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("spattn-bench report: {e}");
                ExitCode::FAILURE
            }
        },
        Parsed::Run(args) => match args.gpus {
            Some(n) => match scaling::run(&args, &argv, n) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("spattn-bench: {e}");
                    ExitCode::FAILURE
                }
            },
            None => run_cases(&args, &argv),
        },
    }
}

/// The case table (no --gpus).
fn run_cases(args: &cli::RunArgs, argv: &[String]) -> ExitCode {
    match run::run(args, argv) {
        Ok(outcome) if outcome.success() => ExitCode::SUCCESS,
        Ok(outcome) => {
            eprintln!(
                "spattn-bench: {} case run(s) failed the accuracy check, {} stopped with an error",
                outcome.failed, outcome.errors
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("spattn-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
