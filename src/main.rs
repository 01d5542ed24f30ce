//! The `sluice` binary: declares the global allocator, installs the TLS crypto provider, parses
//! the command line and hands it to its subcommand in [`sluice::cli`], whose exit status it
//! returns. Invoked as `ratelimit` (Envoy Gateway's `/bin/ratelimit`), it serves as
//! envoyproxy/ratelimit would, its arguments unread.

use std::process::ExitCode;

use clap::Parser;
use sluice::cli::{self, Cli, Command};

#[global_allocator]
static ALLOCATOR: sluice::allocator::Allocator = sluice::allocator::ALLOCATOR;

fn main() -> ExitCode {
    sluice::tls::install_crypto_provider();
    let mut args = std::env::args_os();
    if args
        .next()
        .is_some_and(|argv0| cli::invoked_as_reference(&argv0))
    {
        return cli::serve::run_as_reference(&args.collect::<Vec<_>>());
    }
    match Cli::parse().command.unwrap_or_default() {
        Command::Serve(args) => cli::serve::run(&args),
        Command::Check(args) => cli::check::run(&args),
        Command::Replay(args) => cli::replay::run(&args),
        Command::Probe(args) => cli::probe::run(&args),
        Command::Top(args) => cli::top::run(&args),
    }
}
