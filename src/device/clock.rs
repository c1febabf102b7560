//! A training step's clock. On the CPU a phase's time is the host's clock between its marks. On a
//! GPU the host only queues the work, so its clock measures the launches; waiting for the device
//! at each mark (a synchronize) gives the work's time but drains the device's queue: the first GPU
//! run lost 9% of PyTorch's tokens/s to one such wait a step (docs/gpus.md). So a mark on a GPU
//! also records a CUDA event on the rank's stream, and a [`Span`] between two marks is read from
//! the events once the device has passed them: by [`Pending`] as the steps go on (without
//! waiting), and at the interval's end, which waits once for the last.
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::dist::CudaEvent;

/// A point of a step's timeline: the host's clock, and on a GPU an event on the rank's stream.
#[derive(Debug, Clone)]
pub struct Mark {
    host: Instant,
    event: Option<Arc<CudaEvent>>,
}

/// Marks the present on `device`. On a GPU whose event cannot be recorded (it has failed: the
/// next operation reports why), the mark waits for the device instead, so times stay right.
pub fn mark(device: tch::Device) -> Mark {
    let event = match device {
        tch::Device::Cuda(index) => match CudaEvent::record(index) {
            Ok(e) => Some(Arc::new(e)),
            Err(_) => {
                super::synchronize(device);
                None
            }
        },
        _ => None,
    };
    Mark { host: Instant::now(), event }
}

/// Time between marks, summed over any number of pairs: known at once where the marks hold no
/// events, read from the device where they do.
#[derive(Debug, Clone, Default)]
pub struct Span {
    known: Duration,
    events: Vec<(Arc<CudaEvent>, Arc<CudaEvent>)>,
    /// The host's clock between the event pairs' marks: their time where an event cannot be read.
    launched: Duration,
}

impl Span {
    pub fn between(from: &Mark, to: &Mark) -> Span {
        let host = to.host.saturating_duration_since(from.host);
        match (&from.event, &to.event) {
            (Some(a), Some(b)) => Span { events: vec![(a.clone(), b.clone())], launched: host, ..Span::default() },
            _ => Span { known: host, ..Span::default() },
        }
    }

    /// A time measured on the host.
    pub fn host(d: Duration) -> Span {
        Span { known: d, ..Span::default() }
    }

    /// Whether the device has passed every mark (no wait; always on the CPU).
    pub fn done(&self) -> bool {
        self.events.iter().all(|(_, to)| to.done().unwrap_or(true))
    }

    /// The time, waiting for the device to pass the last mark where it has not.
    pub fn resolve(&self) -> Duration {
        let device: Option<f64> = self.events.iter().map(|(a, b)| a.seconds_to(b).ok()).sum();
        self.known + device.map_or(self.launched, Duration::from_secs_f64)
    }
}

impl std::ops::Add for Span {
    type Output = Span;
    fn add(mut self, other: Span) -> Span {
        self += other;
        self
    }
}

impl std::ops::AddAssign for Span {
    fn add_assign(&mut self, other: Span) {
        self.known += other.known;
        self.launched += other.launched;
        self.events.extend(other.events);
    }
}

/// Spans added up as the device passes them: each [`Pending::push`] first reads those it has
/// passed (no wait), so at most the device's queue of them is held.
#[derive(Debug, Default)]
pub struct Pending {
    read: Duration,
    waiting: VecDeque<Span>,
}

impl Pending {
    pub fn push(&mut self, span: Span) {
        while self.waiting.front().is_some_and(Span::done) {
            let done = self.waiting.pop_front().expect("checked");
            self.read += done.resolve();
        }
        self.waiting.push_back(span);
    }

    /// The total, waiting for the device to pass the last span.
    pub fn total(&self) -> Duration {
        self.read + self.waiting.iter().map(Span::resolve).sum::<Duration>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_the_cpu_a_span_is_the_host_s_clock_between_its_marks() {
        let a = mark(tch::Device::Cpu);
        std::thread::sleep(Duration::from_millis(20));
        let b = mark(tch::Device::Cpu);
        std::thread::sleep(Duration::from_millis(10));
        let c = mark(tch::Device::Cpu);
        let (ab, bc) = (Span::between(&a, &b), Span::between(&b, &c));
        assert!(ab.done());
        assert!(ab.resolve() >= Duration::from_millis(20), "{ab:?}");
        assert_eq!((ab.clone() + bc.clone()).resolve(), ab.resolve() + bc.resolve());
        assert_eq!(Span::between(&a, &c).resolve(), c.host - a.host);
        let mut pending = Pending::default();
        for s in [ab.clone(), bc.clone(), Span::host(Duration::from_secs(1))] {
            pending.push(s);
        }
        assert_eq!(pending.total(), ab.resolve() + bc.resolve() + Duration::from_secs(1));
        assert!(pending.waiting.len() <= 1, "spans the device has passed are read as they come");
    }
}
