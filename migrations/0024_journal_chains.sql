-- The newest chains of an agent's journal (a turn's first line starts its chain), so that a
-- turn's context and `journal.search` read the agent's latest turns without going through
-- its whole history.
CREATE INDEX agent_journal_chains_idx ON agent_journal (agent, at DESC) WHERE seq = 1;
