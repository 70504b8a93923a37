-- Argo CD health check of kvpilot.dev/InferenceService (Lua 5.1, as Argo CD runs it).
-- Reads the conditions the operator writes: Ready / Progressing / Degraded and kstatus'
-- Reconciling / Stalled. Shipped by the kvpilot chart (argocd.healthCheck) and tested in CI
-- against statuses made by the operator's own status builder.
local hs = { status = "Progressing", message = "Waiting for the kvpilot operator to report status" }
if obj.status == nil then
  return hs
end
local generation = obj.metadata and obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.message = "Waiting for the kvpilot operator to observe generation " .. generation
  return hs
end
local conditions = {}
for _, condition in ipairs(obj.status.conditions or {}) do
  conditions[condition.type] = condition
end
local function is_true(type)
  return conditions[type] ~= nil and conditions[type].status == "True"
end
local function describe(condition)
  return (condition.reason or "") .. ": " .. (condition.message or "")
end
for _, pair in ipairs({ { "Stalled", "Degraded" }, { "Reconciling", "Progressing" } }) do
  local found = (is_true(pair[1]) and conditions[pair[1]]) or (is_true(pair[2]) and conditions[pair[2]])
  if found then
    hs.status = pair[2] == "Degraded" and "Degraded" or "Progressing"
    hs.message = describe(found)
    return hs
  end
end
local ready = conditions["Ready"]
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = describe(ready)
  return hs
end
if ready ~= nil and ready.reason == "ScaledToZero" then
  hs.status = "Suspended"
  hs.message = describe(ready)
  return hs
end
if ready ~= nil then
  hs.message = describe(ready)
end
return hs
