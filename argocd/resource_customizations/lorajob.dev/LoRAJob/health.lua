-- Argo CD health of a LoRAJob (lorajob.dev/v1alpha1), from the status the operator writes.
--   Healthy      phase Succeeded
--   Degraded     phase Failed, with the operator's message
--   Suspended    only when the user set spec.suspend (a LoRAJob queued by Kueue is Progressing)
--   Progressing  Pending, Queued, Converting, Training, Exporting, and whenever the status is older
--                than the spec (status.observedGeneration < metadata.generation), so a stale
--                phase is never reported for a changed spec
-- A True TrackingDegraded (an experiment tracker does not take what the trainer sends it) never changes the
-- health, as it never stops training: it is appended to the message of any health but Degraded.
local hs = {}

local RUNNING_PHASES = {
  Pending = true, Queued = true, Converting = true, Training = true, Exporting = true, Suspended = true,
}

local function condition_message(status, condition_type)
  if status.conditions == nil then
    return nil
  end
  for _, condition in ipairs(status.conditions) do
    if condition.type == condition_type and condition.status == "True" and condition.message ~= nil
        and condition.message ~= "" then
      return condition.message
    end
  end
  return nil
end

local function message_of(status, condition_type, fallback)
  if status.message ~= nil and status.message ~= "" then
    return status.message
  end
  return condition_message(status, condition_type) or fallback
end

local status = obj.status
local generation = obj.metadata.generation or 0
local suspended_by_user = obj.spec ~= nil and obj.spec.suspend == true

if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the lorajob operator to pick up the LoRAJob"
  return hs
end

if status.observedGeneration == nil or status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the lorajob operator to observe generation " .. generation
  return hs
end

local phase = status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = message_of(status, "Succeeded", "LoRAJob succeeded")
elseif phase == "Failed" then
  hs.status = "Degraded"
  hs.message = message_of(status, "Failed", "LoRAJob failed")
elseif suspended_by_user then
  hs.status = "Suspended"
  hs.message = message_of(status, "Suspended", "LoRAJob is suspended (spec.suspend is true)")
elseif RUNNING_PHASES[phase] then
  hs.status = "Progressing"
  hs.message = message_of(status, phase, phase)
else
  hs.status = "Unknown"
  hs.message = "Unknown LoRAJob phase " .. tostring(phase)
end
local tracking = condition_message(status, "TrackingDegraded")
if tracking ~= nil and hs.status ~= "Degraded" then
  hs.message = hs.message .. "; tracking degraded: " .. tracking
end
return hs
