//! Backing off between attempts at something that failed (a lost connection, a restarting
//! Postgres): the adapter never gives up, it waits longer, up to a ceiling, and starts
//! over at the floor after a success.

use std::time::Duration;

/// Doubling delays between `floor` and `ceiling`.
#[derive(Debug, Clone)]
pub struct Backoff {
    floor: Duration,
    ceiling: Duration,
    next: Duration,
}

impl Backoff {
    pub fn new(floor: Duration, ceiling: Duration) -> Self {
        Self { floor, ceiling, next: floor }
    }

    /// The delay to wait now; the one after is twice as long, up to the ceiling.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.ceiling);
        d
    }

    /// After a success: the next failure waits the floor again.
    pub fn reset(&mut self) {
        self.next = self.floor;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_ceiling_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500));
        let got: Vec<u128> = (0..5).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 500, 500]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }
}
