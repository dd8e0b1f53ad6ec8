//! A spinner for slow steps: shown only when a step takes longer than half a second, so quick
//! runs print nothing but their results.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How long a step may run before its spinner appears.
pub const SPINNER_DELAY: Duration = Duration::from_millis(500);

/// Runs `work`, showing an indicatif spinner labelled `label` on stderr once it has taken
/// longer than [`SPINNER_DELAY`] (indicatif draws nothing where stderr is not a terminal).
/// Returns the result and the seconds the step took.
pub fn step<T>(label: &str, work: impl FnOnce() -> T) -> (T, f64) {
    let (done, wait) = mpsc::channel::<()>();
    let label = label.to_owned();
    let start = Instant::now();
    let spinner = std::thread::spawn(move || {
        // Dropping `done` (the step finished) disconnects the channel: no spinner.
        if wait.recv_timeout(SPINNER_DELAY) != Err(RecvTimeoutError::Timeout) {
            return;
        }
        let bar = ProgressBar::new_spinner();
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
            bar.set_style(style);
        }
        bar.set_message(label);
        bar.enable_steady_tick(Duration::from_millis(100));
        let _ = wait.recv();
        bar.finish_and_clear();
    });
    let out = work();
    drop(done);
    // The spinner thread only waits on the channel and draws; it cannot panic on our data.
    let _ = spinner.join();
    (out, start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    #[test]
    fn returns_the_result() {
        let (x, secs) = super::step("adding", || 1 + 1);
        assert_eq!(x, 2);
        assert!(secs >= 0.0);
    }
}
