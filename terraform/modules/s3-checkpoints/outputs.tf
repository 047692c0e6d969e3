output "bucket_name" {
  description = "The checkpoint bucket's name."
  value       = aws_s3_bucket.this.id
}

output "bucket_arn" {
  description = "The checkpoint bucket's ARN."
  value       = aws_s3_bucket.this.arn
}

output "checkpoint_uri_prefix" {
  description = "Run URIs start with this: put s3://<bucket>/<prefix><run> in the training config's cloudckpt.uri."
  value       = "s3://${aws_s3_bucket.this.id}/${var.checkpoint_prefix}"
}

output "policy_arn" {
  description = "The least-privilege checkpoint policy; attach it to other roles that run cloudckpt (e.g. a CI or evaluation role)."
  value       = aws_iam_policy.checkpoints.arn
}

output "policy_json" {
  description = "The checkpoint policy document, for review."
  value       = data.aws_iam_policy_document.checkpoints.json
}

output "irsa_role_arn" {
  description = "Annotate the Kubernetes service account with it: eks.amazonaws.com/role-arn (null without create_irsa_role)."
  value       = var.create_irsa_role ? aws_iam_role.irsa[0].arn : null
}
