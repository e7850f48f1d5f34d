-- Every delivery a grant approves counts its use on that grant's one row, and inserts an
-- approval naming it. The foreign key from approvals made each of those transactions take
-- a key-share lock on the grant's row as well, so under load every version of the row
-- carried a multixact of many lockers, which every read and update of the row had to
-- expand: a fifth of Postgres's CPU in the pipeline benchmark, all on one row. Grants can
-- never be deleted (trigger grants_no_delete), and an approval names the grant that the
-- same transaction matched and counted, so the key guarded nothing else.
ALTER TABLE approvals DROP CONSTRAINT approvals_grant_fk;

