//! Progress for slow steps: a spinner for one-off steps (loading, planning, the f64 reference)
//! and a counter for the timed repetitions. Both appear only once a step has taken longer than
//! half a second, and only where stdout and stderr are both terminals: piped output, logs and
//! JSON never see them.

use std::io::IsTerminal;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How long a step may run before its spinner appears.
pub const SPINNER_DELAY: Duration = Duration::from_millis(500);

/// Whether progress may be drawn: stdout and stderr are both terminals (a piped stdout would
/// interleave its lines with the redraws of stderr on the same screen).
pub fn interactive() -> bool {
    std::io::stdout().is_terminal() && std::io::stderr().is_terminal()
}

/// Runs `work`, showing an indicatif spinner labelled `label` on stderr once it has taken
/// longer than [`SPINNER_DELAY`] (only where [`interactive`]). Returns the result and the
/// seconds the step took.
pub fn step<T>(label: &str, work: impl FnOnce() -> T) -> (T, f64) {
    if !interactive() {
        let start = Instant::now();
        let out = work();
        return (out, start.elapsed().as_secs_f64());
    }
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

/// A counted step (the warm-up and timed runs of a case): a bar `label [pos/total]` on stderr
/// once the runs have taken longer than [`SPINNER_DELAY`], where [`interactive`]; cleared when
/// dropped.
pub struct Counter {
    label: String,
    total: u64,
    done: u64,
    start: Instant,
    enabled: bool,
    bar: Option<ProgressBar>,
}

impl Counter {
    /// A counter of `total` runs.
    pub fn new(label: impl Into<String>, total: u64) -> Self {
        Counter {
            label: label.into(),
            total,
            done: 0,
            start: Instant::now(),
            enabled: interactive(),
            bar: None,
        }
    }

    /// One more run done.
    pub fn inc(&mut self) {
        self.done += 1;
        if let Some(bar) = &self.bar {
            bar.set_position(self.done);
        } else if self.enabled && self.start.elapsed() >= SPINNER_DELAY {
            let bar = ProgressBar::new(self.total);
            if let Ok(style) =
                ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ({elapsed}, eta {eta})")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(self.label.clone());
            bar.set_position(self.done);
            self.bar = Some(bar);
        }
    }

    /// Runs done so far.
    pub fn done(&self) -> u64 {
        self.done
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn returns_the_result() {
        let (x, secs) = super::step("adding", || 1 + 1);
        assert_eq!(x, 2);
        assert!(secs >= 0.0);
    }

    #[test]
    fn counts_without_a_terminal() {
        // Under the test harness stdout is captured: nothing is drawn, runs are still counted.
        let mut c = super::Counter::new("timing", 3);
        for _ in 0..3 {
            c.inc();
        }
        assert_eq!(c.done(), 3);
    }
}
