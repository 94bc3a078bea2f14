-- tool_flow_held (sidecar/sql/functions/flow.sql) returns the claim's row by its type,
-- tool_job_claim_row (migration 017), instead of spelling its 18 columns out again: one
-- definition of the row a claim returns. CREATE OR REPLACE cannot change a function's
-- return type, so the old one is dropped here and flow.sql defines the new one right
-- after the migrations. tool_job_claim_flow calls it from plpgsql (no dependency to drop)
-- and its callers see the same columns. No grant names it: every role reaches it only
-- through the claim.
-- compatible-from: 19
DROP FUNCTION IF EXISTS tool_flow_held(text, text, float8);
