-- Tell the sidecar p_owner that its job p_job was cancelled while it ran: a NOTIFY (sent
-- at commit) on the channel only that sidecar listens on, 'sidecar_cancel_' and the md5
-- of its owner id in hex (sidecar.worker.claim_loop.cancel_channel); the payload is the
-- job id. Nothing when p_owner is NULL. Always true, so a query can call it in WHERE.
CREATE OR REPLACE FUNCTION tool_job_tell_owner(p_owner text, p_job uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF p_owner IS NOT NULL THEN
        PERFORM pg_notify('sidecar_cancel_' || md5(p_owner), p_job::text);
    END IF;
    RETURN true;
END
$$;

-- A cancel that needs no UPDATE right on tool_jobs (issue 29, point 6): the callers' role
-- (`sidecar migrate --caller-role`, docs/operations.md "Roles and Secrets"; the MCP
-- gateway's) enqueues, waits, reads and cancels, but may not write a lease, a claim or a
-- state of its own choosing. So the cancel (queries.sql cancel_job, what `sidecar cancel`,
-- sidecar.client and the gateway run) is this function, which writes with its owner's
-- rights (SECURITY DEFINER, the schema owner that ran the migrations) under a search_path
-- pinned to its own schema with pg_temp last, as tool_job_demand does. EXECUTE is taken
-- from PUBLIC: the owner, the worker role (its grants take every tool_job_* function) and
-- the caller role may call it. A role given table rights by hand instead of by `sidecar
-- migrate --worker-role` needs EXECUTE on it for `sidecar cancel`.
--
-- The checks every definer function that acts for someone makes on its inputs (issue 41,
-- point 2: the function is the only way in, so it bounds what it journals): p_by, who
-- asked, NULL or 1-512 printable characters; p_tags, NULL or a JSON object of at most 16
-- members. Raises SQLSTATE 22023 naming the field; returns nothing.
CREATE OR REPLACE FUNCTION tool_job_check_actor(p_by text, p_tags jsonb) RETURNS void
SET search_path FROM CURRENT
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_by IS NOT NULL AND (length(p_by) NOT BETWEEN 1 AND 512 OR btrim(p_by) = ''
                             OR p_by ~ '[\x01-\x1f\x7f-\x9f]') THEN
        RAISE EXCEPTION 'by must be 1-512 printable characters, e.g. ''sidecar web (alice)'' '
                        '(NULL: not said)' USING ERRCODE = '22023';
    END IF;
    IF p_tags IS NOT NULL AND (jsonb_typeof(p_tags) <> 'object'
            OR (SELECT count(*) FROM jsonb_object_keys(p_tags)) NOT BETWEEN 1 AND 16) THEN
        RAISE EXCEPTION 'tags: a JSON object of 1-16 tags, e.g. ''{"run": "42"}''::jsonb '
                        '(NULL: no tag selection)' USING ERRCODE = '22023';
    END IF;
END
$$;

-- The job p_job, or every queued or running job whose tags contain p_tags, and every
-- later stage of them still queued or running. A running job keeps its owner, token and
-- lease end (case F14); its owner is told at commit (tool_job_tell_owner: a NOTIFY on the
-- owner's cancel channel), renews at once, gets zero rows and kills the tree within about
-- a second; a lost notification leaves it to the owner's next heartbeat (issue 41). p_by
-- says who asked, journaled as job_cancelled's "by" (left out when NULL). p_by and p_tags
-- are checked (tool_job_check_actor: 22023 naming the field).
-- The job's error says "cancelled by its MCP client" when the MCP gateway asked for its
-- caller (p_by 'sidecar mcp (PRINCIPAL)', sidecar.mcp.gateway.cancelled_by; issue 41,
-- point 16), and "cancelled by an operator" otherwise: the caller reads it, who it was
-- is journaled.
CREATE OR REPLACE FUNCTION tool_job_cancel(p_job uuid, p_tags jsonb, p_by text)
RETURNS TABLE (cancelled_id uuid, previous_state text)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
BEGIN
PERFORM tool_job_check_actor(p_by, p_tags);
RETURN QUERY
WITH RECURSIVE chain AS (
    SELECT id FROM tool_jobs WHERE id = p_job
    UNION
    SELECT id FROM tool_jobs
    WHERE p_tags IS NOT NULL AND tags @> p_tags AND tags <> '{}'::jsonb
      AND state IN ('queued', 'running', 'waiting')
    UNION ALL
    SELECT c.id FROM tool_jobs c JOIN chain ON c.parent_id = chain.id
), target AS (
    SELECT j.id, j.state AS previous_state FROM tool_jobs j
    WHERE j.id IN (SELECT id FROM chain) AND j.state IN ('queued', 'running', 'waiting')
    FOR UPDATE
), cancelled AS (
    UPDATE tool_jobs j
    SET state = 'cancelled', finished_at = now(),
        lease_until = CASE WHEN target.previous_state = 'running' AND j.lease_until > now()
                           THEN j.lease_until END,
        -- its slot stays taken until the owner confirms the tree dead (migration 016)
        cancel_pending = target.previous_state = 'running' AND j.lease_until > now(),
        error = jsonb_build_object('kind', 'cancelled', 'message',
                                   CASE WHEN p_by LIKE 'sidecar mcp (%'
                                        THEN 'cancelled by its MCP client'
                                        ELSE 'cancelled by an operator' END)
    FROM target
    WHERE j.id = target.id
    RETURNING j.id, j.fencing_token, target.previous_state, j.owner_id, j.cancel_pending
), journal AS (
    INSERT INTO tool_job_events (job_id, fencing_token, event, details)
    SELECT id, fencing_token, 'job_cancelled',
           jsonb_strip_nulls(jsonb_build_object('previous_state', previous_state,
                                                'by', p_by))
    FROM cancelled
)
SELECT cancelled.id, cancelled.previous_state FROM cancelled
WHERE tool_job_tell_owner(CASE WHEN cancelled.cancel_pending THEN cancelled.owner_id END,
                          cancelled.id);
END
$$;

-- The cancel without p_by (migration 018's), kept for releases built for schema 18.
CREATE OR REPLACE FUNCTION tool_job_cancel(p_job uuid, p_tags jsonb)
RETURNS TABLE (cancelled_id uuid, previous_state text)
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE sql VOLATILE AS $$
SELECT * FROM tool_job_cancel(p_job, p_tags, NULL::text)
$$;

REVOKE EXECUTE ON FUNCTION tool_job_cancel(uuid, jsonb, text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION tool_job_cancel(uuid, jsonb) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION tool_job_tell_owner(text, uuid) FROM PUBLIC;
