//! Who made a change: an agent, a human principal, a worker, or the system itself.

/// Who made a change: an agent, a human principal, a worker, or the system itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub kind: &'static str,
    pub id: String,
}

impl Actor {
    pub fn new(kind: &'static str, id: impl Into<String>) -> Self {
        Self { kind, id: id.into() }
    }
    pub fn system(what: &str) -> Self {
        Self::new("system", what)
    }
    /// `kind:id`, as events and receipts show it.
    pub fn label(&self) -> String {
        format!("{}:{}", self.kind, self.id)
    }
}
