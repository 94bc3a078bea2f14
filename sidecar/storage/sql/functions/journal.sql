-- The journal (tool_job_events, P22).

-- An attempt's journal rows travel with the statement that ends it: events noted while the
-- attempt ran (tool_request_started, child_killed; a JSON array of {event, age_s, details})
-- are written by the same statement as its final event, in order, each at its own time
-- (now() less its age in seconds), instead of one round trip each.
CREATE OR REPLACE FUNCTION tool_job_journal_rows(
    earlier jsonb, last_event text, last_details jsonb)
RETURNS TABLE (event text, at timestamptz, details jsonb, n bigint)
LANGUAGE sql STABLE AS $$
    SELECT d->>'event', now() - (d->>'age_s')::float8 * interval '1 second',
           coalesce(d->'details', '{}'::jsonb), x.n
    FROM jsonb_array_elements(coalesce(earlier, '[]'::jsonb)) WITH ORDINALITY AS x(d, n)
    UNION ALL
    SELECT last_event, now(), last_details, 9223372036854775807
    WHERE last_event IS NOT NULL
$$;
