-- Approvals (issue 44, point 1; migration 030, docs/side-effects.md "Approval"): the
-- answer a person gives to a tool's request, bound to the attempt that asked.

-- Answer the approval request of job p_job asked by attempt p_attempt with fencing token
-- p_token: approve (p_approve true) or deny, with p_reason (NULL or 1-500 printable
-- characters) and who answered, p_by (1-256 printable characters). Accepted only while
-- that request is pending and before its deadline, and that attempt still owns the job
-- (running, its token, its lease not ended) or parked it (waiting, its token): then the
-- request says so and the journal says approval_answered; a parked job is queued again
-- with the answer (tool_jobs.approval, the next attempt's SIDECAR_APPROVAL; a sidecar of
-- its tool woken) or, denied, fails `denied`. Otherwise nothing changes but the journal (approval_refused,
-- with why: no_request, already_answered, expired, stale_attempt). Returns the outcome:
-- approved, denied, or the refusal's reason. Callers and the web view may run it
-- (SECURITY DEFINER); bad input raises 22023 naming the field.
CREATE OR REPLACE FUNCTION tool_job_approval_answer(p_job uuid, p_attempt integer,
                                                    p_token bigint, p_approve boolean,
                                                    p_reason text, p_by text)
RETURNS text
SECURITY DEFINER SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_request tool_approvals;
    v_job tool_jobs;
    v_outcome text;
    v_details jsonb;
    v_answer jsonb;
BEGIN
    IF p_job IS NULL OR p_attempt IS NULL OR p_token IS NULL OR p_approve IS NULL THEN
        RAISE EXCEPTION 'an answer names the job, the attempt and the fencing token it '
                        'answers, and whether it approves' USING ERRCODE = '22023';
    END IF;
    IF p_by IS NULL OR length(p_by) NOT BETWEEN 1 AND 256 OR p_by ~ '[\x01-\x1f\x7f-\x9f]' THEN
        RAISE EXCEPTION 'by must be 1-256 printable characters: who answers'
            USING ERRCODE = '22023';
    END IF;
    IF p_reason IS NOT NULL AND (length(p_reason) NOT BETWEEN 1 AND 500
                                 OR p_reason ~ '[\x01-\x09\x0b-\x1f\x7f-\x9f]') THEN
        RAISE EXCEPTION 'reason must be 1-500 printable characters (NULL: none)'
            USING ERRCODE = '22023';
    END IF;
    SELECT * INTO v_job FROM tool_jobs WHERE id = p_job FOR UPDATE;
    SELECT * INTO v_request FROM tool_approvals a
    WHERE a.job_id = p_job AND a.attempt = p_attempt AND a.fencing_token = p_token
    ORDER BY a.asked_at DESC LIMIT 1 FOR UPDATE;
    IF v_job.id IS NULL OR v_request.id IS NULL THEN
        v_outcome := 'no_request';
    ELSIF v_request.state <> 'pending' THEN
        v_outcome := CASE WHEN v_request.state = 'expired' THEN 'expired'
                          ELSE 'already_answered' END;
    ELSIF v_request.deadline <= now() THEN
        v_outcome := 'expired';
    ELSIF v_job.fencing_token <> p_token
          OR NOT ((v_job.state = 'running' AND v_job.lease_until > now())
                  OR v_job.state = 'waiting') THEN
        v_outcome := 'stale_attempt';
    ELSE
        v_outcome := CASE WHEN p_approve THEN 'approved' ELSE 'denied' END;
        UPDATE tool_approvals SET state = v_outcome, answered_at = now(), answered_by = p_by,
                                  reason = p_reason
        WHERE id = v_request.id;
        IF v_job.state = 'waiting' THEN
            v_answer := jsonb_strip_nulls(jsonb_build_object(
                'request_id', v_request.id, 'action', v_request.action,
                'summary', v_request.summary, 'approved', p_approve, 'by', p_by,
                'reason', p_reason, 'answered_at', now(),
                'waited_s', round(extract(epoch FROM now() - v_request.asked_at)::numeric,
                                  3)));
            IF p_approve THEN
                UPDATE tool_jobs SET state = 'queued', run_after = now(), approval = v_answer
                WHERE id = p_job;
                PERFORM tool_job_wake(v_job.tool, 1);
            ELSE
                UPDATE tool_jobs
                SET state = 'failed', finished_at = now(), approval = v_answer,
                    error = jsonb_strip_nulls(jsonb_build_object(
                        'kind', 'denied', 'action', v_request.action,
                        'message', format('%s denied the step %s', p_by,
                                          quote_literal(v_request.action))
                                   || coalesce(': ' || p_reason, '')))
                WHERE id = p_job;
            END IF;
        END IF;
    END IF;
    v_details := jsonb_strip_nulls(jsonb_build_object(
        'request_id', v_request.id, 'attempt', p_attempt, 'outcome', v_outcome,
        'approve', p_approve, 'by', p_by, 'reason', p_reason));
    IF v_job.id IS NOT NULL AND v_outcome IN ('approved', 'denied') THEN
        INSERT INTO tool_job_events (job_id, fencing_token, event, details)
        SELECT p_job, p_token, 'approval_answered',
               v_details || jsonb_build_object('waited_s', round(extract(
                   epoch FROM now() - v_request.asked_at)::numeric, 3));
    ELSIF v_job.id IS NOT NULL THEN
        INSERT INTO tool_job_events (job_id, fencing_token, event, details)
        SELECT p_job, p_token, 'approval_refused', v_details;
    END IF;
    RETURN v_outcome;
END
$$;

REVOKE EXECUTE ON FUNCTION tool_job_approval_answer(uuid, integer, bigint, boolean, text, text)
    FROM PUBLIC;

-- Park job p_job (issue 44): the attempt (p_owner, p_token; running, its lease not
-- ended) asked a person's yes in park mode (request p_request) and its tool exited. Locks
-- the job, then the request (the order tool_job_approval_answer and the expiry sweep take
-- too). Still open: the job waits (`waiting`: no owner, no lease, its slot freed, its
-- attempt given back, its start deadline lifted: the request's deadline bounds the wait).
-- Answered while the tool was exiting: the answer is applied now, as it would have been
-- to the parked job (approved: queued again with it; denied: failed `denied`); expired:
-- failed `approval_expired`. Journals job_parked after p_earlier (the attempt's earlier
-- events) with p_details. Returns the outcome (parked, approved, denied, expired) and the
-- request's deadline; no row when the attempt no longer owns the job.
CREATE OR REPLACE FUNCTION tool_job_park(p_job uuid, p_owner text, p_token bigint,
                                         p_request uuid, p_details jsonb, p_earlier jsonb)
RETURNS TABLE (outcome text, deadline timestamptz)
SET search_path FROM CURRENT
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_job tool_jobs;
    v_request tool_approvals;
    v_outcome text;
BEGIN
    SELECT * INTO v_job FROM tool_jobs j
    WHERE j.id = p_job AND j.owner_id = p_owner AND j.fencing_token = p_token
      AND j.state = 'running' AND j.lease_until > now()
    FOR UPDATE;
    IF v_job.id IS NULL THEN
        RETURN;
    END IF;
    SELECT * INTO v_request FROM tool_approvals a
    WHERE a.id = p_request AND a.job_id = p_job FOR UPDATE;
    IF v_request.id IS NULL THEN
        RETURN;
    END IF;
    v_outcome := CASE WHEN v_request.state = 'pending' AND v_request.deadline <= now()
                      THEN 'expired' WHEN v_request.state = 'pending' THEN 'parked'
                      ELSE v_request.state END;
    INSERT INTO tool_job_events (job_id, fencing_token, event, at, details)
    SELECT p_job, p_token, e.event, e.at, e.details
    FROM tool_job_journal_rows(p_earlier, 'job_parked', p_details || jsonb_build_object(
        'request_id', p_request, 'action', v_request.action, 'deadline', v_request.deadline,
        'outcome', v_outcome)) e
    ORDER BY e.n;
    IF v_outcome = 'parked' THEN
        UPDATE tool_jobs SET state = 'waiting', owner_id = NULL, lease_until = NULL,
                             attempt = attempt - 1, expires_at = NULL
        WHERE id = p_job;
    ELSIF v_outcome = 'approved' THEN
        UPDATE tool_jobs
        SET state = 'queued', owner_id = NULL, lease_until = NULL, attempt = attempt - 1,
            expires_at = NULL, run_after = now(),
            approval = jsonb_strip_nulls(jsonb_build_object(
                'request_id', v_request.id, 'action', v_request.action,
                'summary', v_request.summary, 'approved', true, 'by', v_request.answered_by,
                'reason', v_request.reason, 'answered_at', v_request.answered_at,
                'waited_s', round(extract(epoch FROM v_request.answered_at
                                          - v_request.asked_at)::numeric, 3)))
        WHERE id = p_job;
        PERFORM tool_job_wake(v_job.tool, 1);
    ELSE
        IF v_outcome = 'expired' THEN
            UPDATE tool_approvals SET state = 'expired' WHERE id = v_request.id;
        END IF;
        UPDATE tool_jobs
        SET state = 'failed', owner_id = NULL, lease_until = NULL, finished_at = now(),
            error = CASE WHEN v_outcome = 'denied' THEN jsonb_strip_nulls(jsonb_build_object(
                    'kind', 'denied', 'action', v_request.action,
                    'message', format('%s denied the step %s', v_request.answered_by,
                                      quote_literal(v_request.action))
                               || coalesce(': ' || v_request.reason, '')))
                ELSE jsonb_build_object('kind', 'approval_expired', 'action', v_request.action,
                    'message', format('nobody answered the approval of the step %s by its '
                                      'deadline (%s)', quote_literal(v_request.action),
                                      v_request.deadline))
                END
        WHERE id = p_job;
    END IF;
    RETURN QUERY SELECT v_outcome, v_request.deadline;
END
$$;

REVOKE EXECUTE ON FUNCTION tool_job_park(uuid, text, bigint, uuid, jsonb, jsonb) FROM PUBLIC;
