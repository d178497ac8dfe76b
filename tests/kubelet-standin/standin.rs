//! kubelet-standin: a TEST STAND-IN for the kubelet, built so the tests have
//! `env!("CARGO_BIN_EXE_kubelet-standin")`. Not shipped. The program is
//! `inplace_agent::sandbox::standin` (see there for what it does).

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    inplace_agent::sandbox::standin::run(&args)
}
